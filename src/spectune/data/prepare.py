"""Dataset preparation: exact-duplicate removal, a max-token filter, a seeded train/eval split,
benchmark prompts, and the statistics `spectune data inspect` prints. Every drop is counted."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from spectune.atomic import atomic_path
from spectune.config import Settings, positional
from spectune.data.read import Dialogue, read_dialogues, write_jsonl
from spectune.errors import SpectuneError


class SplitSettings(Settings):
    """Which dialogues are held out and how records are read: one definition for a run's `data:` section and for
    every trainer's inputs."""

    eval_data: Path | None = Field(None, description="Held-out dataset (default: a seeded split of the data).")
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share held out when no eval data is given.")
    system: str | None = Field(None, description="System prompt to prepend where a record has none.")
    seed: int = Field(0, description="Seed of the split (and of training: initialisation and order).")


DATASET = "Chat JSONL (OpenAI messages, ShareGPT or Alpaca) or a save_to_disk folder."


class ReadConfig(Settings):
    """What `spectune data validate` takes: a dataset and how its records are read."""

    data: Path = Field(**positional(DATASET))
    system: str | None = SplitSettings.model_fields["system"]


class InspectConfig(ReadConfig):
    """Everything `spectune data inspect` takes."""

    tokenizer: Path | None = Field(None, description="Local tokenizer folder to count tokens with (else words).")
    json_out: Path | None = Field(None, description="Also write the numbers as JSON here.")


class PrepareConfig(Settings):
    """Everything `spectune data prepare` takes."""

    data: Path = Field(**positional(DATASET))
    out: Path = Field(description="Folder for train.jsonl and eval.jsonl.")
    eval_fraction: float = SplitSettings.model_fields["eval_fraction"]
    seed: int = SplitSettings.model_fields["seed"]
    system: str | None = SplitSettings.model_fields["system"]
    dedup: bool = Field(True, description="Remove exact duplicates.")
    max_seq_length: int | None = Field(
        None, ge=1, description="Drop dialogues longer than this many tokens (needs --tokenizer)."
    )
    tokenizer: Path | None = Field(None, description="Local tokenizer folder to count tokens with.")
    skip_invalid: bool = Field(False, description="Drop invalid records (counted) instead of failing.")


class PromptsConfig(Settings):
    """Everything `spectune data prompts` takes."""

    data: Path = Field(**positional(DATASET))
    out: Path = Field(description="JSONL of {messages, reference}.")
    n: int = Field(50, ge=1, description="How many prompts.")
    seed: int = Field(0, description="Which prompts: the same seed gives the same prompts.")
    system: str | None = SplitSettings.model_fields["system"]


@dataclass
class Split:
    train: list[Dialogue]
    eval: list[Dialogue]
    dropped: Counter[str] = field(default_factory=Counter)


def dedup(dialogues: Sequence[Dialogue]) -> tuple[list[Dialogue], int]:
    """Keep the first of each set of identical dialogues; returns (kept, removed)."""
    seen: set[str] = set()
    kept = []
    for dialogue in dialogues:
        key = dialogue.key()
        if key not in seen:
            seen.add(key)
            kept.append(dialogue)
    return kept, len(dialogues) - len(kept)


def _rank(dialogue: Dialogue, seed: int) -> str:
    # A hash of content and seed: the split does not depend on file order or on other records.
    return hashlib.sha256(f"{seed}\0{dialogue.key()}".encode()).hexdigest()


def split_dialogues(
    dialogues: Sequence[Dialogue],
    *,
    eval_fraction: float = 0.1,
    seed: int = 0,
    remove_duplicates: bool = True,
    max_seq_length: int | None = None,
    count_tokens: Callable[[Dialogue], int] | None = None,
) -> Split:
    """Deterministic train/eval split by `seed`, after dedup and the optional max-token filter."""
    if not 0.0 <= eval_fraction < 1.0:
        raise SpectuneError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    dropped: Counter[str] = Counter()
    items = list(dialogues)
    if remove_duplicates:
        items, removed = dedup(items)
        if removed:
            dropped["exact duplicate"] = removed
    if max_seq_length is not None:
        if count_tokens is None:
            raise SpectuneError("a max-token filter needs a tokenizer")
        before = len(items)
        items = [d for d in items if count_tokens(d) <= max_seq_length]
        if before - len(items):
            dropped[f"longer than {max_seq_length} tokens"] = before - len(items)
    ordered = sorted(items, key=lambda d: _rank(d, seed))
    n_eval = round(len(ordered) * eval_fraction)
    if eval_fraction > 0 and n_eval == 0 and len(ordered) > 1:
        n_eval = 1
    return Split(train=ordered[n_eval:], eval=ordered[:n_eval], dropped=dropped)


@dataclass
class Prompt:
    """A benchmark prompt: the conversation up to an assistant turn, and what the dataset answered there."""

    messages: list[dict[str, str]]
    reference: str

    def to_json(self) -> dict[str, Any]:
        return {"messages": self.messages, "reference": self.reference}


def extract_prompts(dialogues: Sequence[Dialogue], n: int, seed: int = 0) -> list[Prompt]:
    """`n` (context, reference answer) pairs at assistant turns, at most one per dialogue, chosen by `seed`."""
    candidates = []
    for dialogue in sorted(dialogues, key=lambda d: _rank(d, seed)):
        turns = dialogue.messages
        positions = [i for i, t in enumerate(turns) if t["role"] == "assistant" and i > 0]
        if not positions:
            continue
        # Pick the turn by hash too, so the choice is stable when other dialogues change.
        index = positions[int(_rank(dialogue, seed + 1), 16) % len(positions)]
        candidates.append(Prompt([dict(t) for t in turns[:index]], turns[index]["content"]))
        if len(candidates) == n:
            break
    return candidates


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read prompts written by `write_prompts`, or take prompts from any chat dataset."""
    path = Path(path)
    try:
        first = path.open(encoding="utf-8").readline() if path.is_file() else ""
        written = first.strip() and "reference" in json.loads(first)
    except (UnicodeDecodeError, json.JSONDecodeError):  # not a prompts file: the dataset reader says what is wrong
        written = False
    if written:
        rows = [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
        return [Prompt(row["messages"], row["reference"]) for row in rows]
    return extract_prompts(read_dialogues(path).dialogues, n=10**9)


def write_prompts(prompts: Sequence[Prompt], path: str | Path) -> None:
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as handle:
        for prompt in prompts:
            handle.write(json.dumps(prompt.to_json(), ensure_ascii=False) + "\n")


def _percentile(values: Sequence[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else 0.0


def dataset_stats(
    dialogues: Sequence[Dialogue], count: Callable[[str], int], records: int, invalid: int
) -> dict[str, Any]:
    """What `data inspect` shows: sizes, turns, tokens per turn by role, role mix, duplicates."""
    roles: Counter[str] = Counter()
    tokens_by_role: dict[str, list[int]] = {}
    turns_per_dialogue = []
    for dialogue in dialogues:
        turns_per_dialogue.append(len(dialogue.messages))
        for turn in dialogue.messages:
            roles[turn["role"]] += 1
            tokens_by_role.setdefault(turn["role"], []).append(count(turn["content"]))
    _, duplicates = dedup(dialogues)
    return {
        "records": records,
        "dialogues": len(dialogues),
        "invalid_lines": invalid,
        "duplicates": duplicates,
        "turns": sum(turns_per_dialogue),
        "turns_per_dialogue_median": statistics.median(turns_per_dialogue) if dialogues else 0,
        "role_mix": dict(roles),
        "tokens_per_turn": {
            role: {
                "median": statistics.median(values),
                "p95": _percentile(values, 0.95),
                "total": sum(values),
            }
            for role, values in tokens_by_role.items()
        },
    }


def save_split(split: Split, out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl"}
    write_jsonl(split.train, paths["train"])
    write_jsonl(split.eval, paths["eval"])
    return paths
