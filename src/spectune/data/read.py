"""Read chat datasets (OpenAI messages, ShareGPT, Alpaca; JSONL or a `save_to_disk` folder) into dialogues.

Every record is checked; each problem names the file, the line (or row) and the field.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spectune.atomic import atomic_path
from spectune.errors import Problem, SpectuneError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}


@dataclass
class Dialogue:
    """One conversation: a list of {"role", "content"} turns and where it came from."""

    messages: list[dict[str, str]]
    source: str = ""
    line: int = 0

    def key(self) -> str:
        """Identity for exact-duplicate removal: the turns, nothing else."""
        return json.dumps(self.messages, ensure_ascii=False, sort_keys=True)


@dataclass
class ReadResult:
    dialogues: list[Dialogue]
    format: str
    records: int
    dropped: list[Problem] = field(default_factory=list)

    def drop_reasons(self) -> Counter[str]:
        return Counter(p.message.split(":")[0] for p in self.dropped)


class RecordError(ValueError):
    """A record that cannot be used; `field` says which part of it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def detect_format(record: dict[str, Any]) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    raise RecordError(
        "unknown record format: expected a 'messages' list (OpenAI), a 'conversations' list (ShareGPT) "
        f"or 'instruction' + 'output' (Alpaca); found keys {sorted(record)[:8]}"
    )


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"wrong type: expected a string, got {type(value).__name__}", where)
    if not value.strip():
        raise RecordError("empty content", where)
    return value


def _turns(record: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    if fmt == "alpaca":
        prompt = _text(record["instruction"], "instruction")
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise RecordError(f"wrong type: expected a string, got {type(extra).__name__}", "input")
        turns = [{"role": "user", "content": f"{prompt}\n\n{extra}" if extra.strip() else prompt}]
        turns.append({"role": "assistant", "content": _text(record["output"], "output")})
        if record.get("system"):
            turns.insert(0, {"role": "system", "content": _text(record["system"], "system")})
        return turns
    key, role_key, text_key = (
        ("messages", "role", "content") if fmt == "messages" else ("conversations", "from", "value")
    )
    items = record[key]
    if not isinstance(items, list):
        raise RecordError(f"wrong type: expected a list, got {type(items).__name__}", key)
    if not items:
        raise RecordError("no turns", key)
    turns = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise RecordError(f"wrong type: expected an object, got {type(item).__name__}", where)
        if role_key not in item:
            raise RecordError(f"missing field '{role_key}'", where)
        if text_key not in item:
            raise RecordError(f"missing field '{text_key}'", where)
        raw_role = item[role_key]
        role = raw_role if fmt == "messages" else SHAREGPT_ROLES.get(str(raw_role).lower())
        if role not in ROLES:
            allowed = ROLES if fmt == "messages" else tuple(SHAREGPT_ROLES)
            raise RecordError(f"unknown role {raw_role!r} (allowed: {', '.join(allowed)})", f"{where}.{role_key}")
        if role == "system" and i != 0:
            raise RecordError("a system turn must come first", f"{where}.{role_key}")
        turns.append({"role": role, "content": _text(item[text_key], f"{where}.{text_key}")})
    return turns


def parse_record(
    record: Any, fmt: str | None, system: str | None = None, need_answer: bool = True
) -> tuple[list[dict[str, str]], str]:
    """Turn one raw record into checked turns; returns (turns, detected format). `need_answer`: training data, where
    a dialogue without an assistant turn has nothing to learn (prompts to answer need none)."""
    if not isinstance(record, dict):
        raise RecordError(f"wrong type: expected a JSON object, got {type(record).__name__}")
    this_fmt = detect_format(record)
    if fmt is not None and this_fmt != fmt:
        raise RecordError(f"record is in {this_fmt} format but the file is in {fmt} format")
    turns = _turns(record, this_fmt)
    if need_answer and not any(t["role"] == "assistant" for t in turns):
        raise RecordError("no assistant turn: nothing to train on")
    if system and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": system})
    return turns, this_fmt


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any | RecordError]]:
    with path.open("r", encoding="utf-8", errors="strict") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield number, json.loads(raw)
            except json.JSONDecodeError as exc:
                yield number, RecordError(f"invalid JSON: {exc.msg} at column {exc.colno}")


def _disk_records(path: Path) -> Iterator[tuple[int, Any]]:
    import datasets  # heavy import: only for folders saved by datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        split = "train" if "train" in loaded else next(iter(loaded)) if len(loaded) == 1 else None
        if split is None:
            raise SpectuneError(f"{path}: a DatasetDict with splits {list(loaded)} and no 'train': pick one")
        loaded = loaded[split]
    yield from enumerate(loaded, start=1)


def _records(path: Path) -> Iterable[tuple[int, Any]]:
    if not path.exists():
        raise SpectuneError(f"{path}: no such file or folder")
    if path.is_dir():
        if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
            raise SpectuneError(f"{path}: a folder, but not one saved by datasets.save_to_disk")
        return _disk_records(path)
    return _jsonl_records(path)


def read_dialogues(
    path: str | Path, *, system: str | None = None, skip_invalid: bool = False, need_answer: bool = True
) -> ReadResult:
    """Read and check every record. Bad records raise (all listed at once) unless `skip_invalid`."""
    path = Path(path)
    fmt: str | None = None
    dialogues: list[Dialogue] = []
    problems: list[Problem] = []
    records = 0
    try:
        for number, record in _records(path):
            records += 1
            try:
                if isinstance(record, RecordError):
                    raise record
                turns, fmt = parse_record(record, fmt, system, need_answer)
            except RecordError as exc:
                problems.append(Problem(str(path), str(exc), number, exc.field))
                continue
            dialogues.append(Dialogue(turns, str(path), number))
    except UnicodeDecodeError as exc:
        raise SpectuneError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if problems and not skip_invalid:
        raise SpectuneError(f"{path}: {len(problems)} invalid record(s) of {records}", problems)
    if not dialogues:
        raise SpectuneError(f"{path}: no usable dialogues ({records} records read)", problems)
    return ReadResult(dialogues, fmt or "messages", records, problems)


def assistant_turns(path: str | Path) -> list[str]:
    """Every assistant turn of a chat dataset, in order (what n-gram lookup's domain table is built from)."""
    return [
        turn["content"] for d in read_dialogues(path).dialogues for turn in d.messages if turn["role"] == "assistant"
    ]


def write_jsonl(dialogues: Iterable[Dialogue], path: str | Path) -> int:
    """Write dialogues as OpenAI-messages JSONL, atomically (temporary name, then rename)."""
    count = 0
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as handle:
        for dialogue in dialogues:
            handle.write(json.dumps({"messages": dialogue.messages}, ensure_ascii=False) + "\n")
            count += 1
    return count
