"""Each draft's GGUF type chosen by what it buys: measured in llama.cpp on the quantized files, priced on the card.

On a GPU a small draft's step is mostly the card's per-layer floor, not its bytes, so a larger type can buy more
acceptance than it costs (a tuned 0.5B kept 74% of its top-1 at Q4_K_M). Every candidate type of a draft is
quantized plainly and, where the export had an importance matrix, also weighted by it (the matrix is not better
everywhere), and measured in the real loop's terms: the target's GGUF answers the held-out prompts greedily, each
draft GGUF reads those answers in one batch, and where its greedy token is the target's gives the same match flags
the greedy loop would verify (exact mode: batched logits equal one-token ones). From the flags, the meter's replay
gives α by position and τ at every k; c is the file's own, in bytes and on the reference card. The type with the
best predicted speedup on the card at its best k is served.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from spectune.acceptance.meter import DraftAcceptance, Profile, acceptance_row
from spectune.config import Settings
from spectune.data.prepare import Prompt
from spectune.errors import SpectuneError
from spectune.export.gguf import check_quant, f16_scratch, quantize_f16
from spectune.export.imatrix import IMATRIX_TYPES
from spectune.gpu.card import GROUNDED_PROFILE, reference_card
from spectune.layout import gguf_name
from spectune.runtime.chat import chat_tokens
from spectune.runtime.llama import LlamaModel
from spectune.runtime.profile import gguf_weights
from spectune.speedup import GPU_PROFILE, Weights, step_cost_ratio

DRAFT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


class DraftTypesSettings(Settings):
    draft_types: list[str] = Field(
        list(DRAFT_TYPES),
        description="GGUF types each draft model is measured at in llama.cpp (with the exported GGUFs); the one with "
        "the best predicted speedup on the reference card is served. [] serves every draft at export.quant.",
    )
    type_margin: float = Field(
        0.02,
        ge=0,
        lt=1,
        description="A larger type (or a type weighted by the importance matrix, over its plain file) is served only "
        "where its predicted speedup beats the others' by more than this fraction: below it, the sweep's prompts "
        "cannot tell them apart.",
    )

    @field_validator("draft_types")
    @classmethod
    def _known_types(cls, types: list[str]) -> list[str]:
        """Checked when the config is read, not after the training stages."""
        try:
            return [check_quant(quant) for quant in types]
        except SpectuneError as error:
            raise ValueError(str(error)) from error


def card_profiles(draft: Weights, target: Weights, source: str) -> list[Profile]:
    """A draft's GPU profiles from its weights and the target's: memory-bound (c = bytes read, r = 1), and with
    layers (GGUF weights), the reference card's c and r, fitted on published llama.cpp figures."""
    bytes_only = round(step_cost_ratio(draft, target), 4)
    profiles = [Profile(GPU_PROFILE, f"gpu (memory-bound, predicted; c by {source})", bytes_only)]
    if draft.layers and target.layers:
        card = reference_card()
        low, high = card.cost_ratio_band(draft, target)
        name = f"{card.label}, c {low:.3f}-{high:.3f} (fitted on published llama.cpp figures)"
        grounded_c = round(card.cost_ratio(draft, target), 4)
        profiles.append(Profile(GROUNDED_PROFILE, name, grounded_c, card.verify_ratios(target)))
    return profiles


def target_answers(target: LlamaModel, prompts: list[Prompt], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, the target GGUF's greedy answer, its end token included) for each prompt."""
    answered = []
    for prompt in prompts:
        tokens = chat_tokens(target, prompt.messages)
        target.truncate(0)
        logits = target.decode(tokens, 0, all_logits=False)
        answer: list[int] = []
        while len(answer) < max_tokens and len(tokens) + len(answer) < target.n_ctx:
            answer.append(int(np.argmax(logits[-1])))
            if target.is_end(answer[-1]):
                break
            logits = target.decode(answer[-1:], len(tokens) + len(answer) - 1, all_logits=False)
        answered.append((tokens, answer))
    return answered


def gguf_matches(draft: LlamaModel, answered: list[tuple[list[int], list[int]]]) -> list[list[bool]]:
    """Per answer, where the draft GGUF's greedy token (reading the prompt and the answer so far) is the target's."""
    matches = []
    for prompt, answer in answered:
        if not answer:
            continue
        draft.truncate(0)
        if len(prompt) > 1:  # the logits that matter predict the answer: from the prompt's last token on
            draft.decode(prompt[:-1], 0, all_logits=False)
        logits = draft.decode(prompt[-1:] + answer[:-1], len(prompt) - 1)
        matches.append([bool(token == expected) for token, expected in zip(logits.argmax(-1), answer, strict=True)])
    return matches


def as_json(value: dict[str, Any]) -> dict[str, Any]:
    """`value` as its JSON reads back (int keys as strings): the same in a fresh run and a resumed one."""
    return json.loads(json.dumps(value))


@dataclass(frozen=True)
class Candidate:
    """A type a draft is measured at: quantized plainly, or weighted by its importance matrix."""

    quant: str
    weighted: bool = False

    @property
    def label(self) -> str:
        return f"{self.quant}+imatrix" if self.weighted else self.quant

    def file(self, exported: Path, name: str) -> Path:
        """Its GGUF, in a `types/` folder beside the export's (whose files export.json describes)."""
        return exported.parent / "types" / gguf_name(name, self.quant + ("-imatrix" if self.weighted else ""))


def candidates(types: list[str], weighted: bool) -> list[Candidate]:
    """Every type plain, and where there is an importance matrix and the type takes one, also weighted by it: the
    matrix is not better everywhere (measured: a tuned Qwen 0.5B draft lost 4 points of top-1 with it at Q5_K_M)."""
    both = (False, True) if weighted else (False,)
    return [
        Candidate(quant, with_matrix)
        for quant in types
        for with_matrix in both
        if not with_matrix or quant in IMATRIX_TYPES
    ]


def type_files(
    folder: Path, exported: Path, name: str, trials: list[Candidate], calibration: str | None
) -> tuple[dict[Candidate, Path], float]:
    """The draft's GGUF at every candidate, quantized from one F16 conversion as the export quantizes (the same
    importance matrix, cached), always anew (a file left by an earlier run may hold other weights), and the seconds
    that took."""
    paths = {trial: trial.file(exported, name) for trial in trials}
    start = time.perf_counter()
    with f16_scratch(folder, exported) as f16:
        for trial, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            quantize_f16(f16, path, trial.quant, calibration if trial.weighted else None)
    return paths, time.perf_counter() - start


def best_speedup(row: DraftAcceptance) -> tuple[str, int, float]:
    """(profile key, k, S): at the row's recommended k, on the profile it was chosen by (ranking_profile)."""
    return row.recommended_by, row.recommended_k, row.speedup[row.recommended_by][row.recommended_k]


def card_band(row: DraftAcceptance, k: int, draft: Weights, target: Weights) -> tuple[float, float]:
    """The reference card's speedup at k, at its worst and best over the fit's spread of c and r."""
    card = reference_card()
    return card.speedup_band(row.tau_simulated[k], k, card.cost_ratio_band(draft, target), target)


def choose_type(rows: list[dict[str, Any]], margin: float) -> dict[str, Any]:
    """The smallest type whose predicted speedup is within `margin` (a fraction) of the best: a type that wins by
    less is noise (the Gemma 3 run's seqkd draft: α 45.5% at Q6_K against 44.9% at Q4_K_M, where α's standard
    error over its 314 answer tokens is about 3 points, and both predicted 0.95x). Of one type's two files, which
    cost the same step (the weighted one is a few hundred bytes of metadata larger), the plain one unless it is
    outside the margin: the matrix must win clearly to be served."""
    best = max(row["chosen_by"]["speedup"] for row in rows)
    close = [row for row in rows if row["chosen_by"]["speedup"] >= best * (1 - margin)]
    type_bytes: dict[str, int] = {}
    for row in rows:
        type_bytes[row["quant"]] = min(row["bytes"], type_bytes.get(row["quant"], row["bytes"]))
    return min(close, key=lambda row: (type_bytes[row["quant"]], row["imatrix"], -row["chosen_by"]["speedup"]))


def sweep_draft(
    name: str,
    folder: Path,
    exported: Path,
    target_weights: Weights,
    answered: list[tuple[list[int], list[int]]],
    types: list[str],
    calibration: str | None,
    threads: int | None,
    margin: float,
) -> dict[str, Any]:
    """One draft at every type: its trade-off rows and the chosen type (choose_type)."""
    paths, seconds = type_files(folder, exported, name, candidates(types, calibration is not None), calibration)
    rows = []
    for trial, path in paths.items():
        model = LlamaModel(path, threads=threads)
        try:
            matches = gguf_matches(model, answered)
        finally:
            model.close()
        weights = gguf_weights(path)
        row = acceptance_row(f"{name}@{trial.label}", matches, card_profiles(weights, target_weights, "GGUF bytes"))
        key, k, best = best_speedup(row)
        rows.append(
            as_json(
                {
                    "quant": trial.quant,
                    "imatrix": trial.weighted,
                    "label": trial.label,
                    "gguf": str(path),
                    "bytes": path.stat().st_size,
                    "alpha": row.alpha,
                    "alpha_by_position": row.alpha_by_position,
                    "tau": row.tau_simulated,
                    "cost_ratio": row.cost_ratio,
                    "speedup": row.speedup,
                    "best_k": row.best_k,
                    "chosen_by": {"profile": key, "k": k, "speedup": best},
                    # the card's figure with its band (the fit's leave-one-out spread of c and r)
                    "card_band": card_band(row, k, weights, target_weights) if key == GROUNDED_PROFILE else None,
                }
            )
        )
    chosen = choose_type(rows, margin)
    return {"chosen": chosen["label"], "gguf": chosen["gguf"], "seconds_to_quantize": round(seconds, 1), "types": rows}


def sweep_types(
    target_gguf: Path,
    drafts: dict[str, tuple[Path, Path]],
    prompts: list[Prompt],
    max_tokens: int,
    types: list[str],
    calibration: dict[str, str] | None = None,
    threads: int | None = None,
    margin: float = DraftTypesSettings.model_fields["type_margin"].default,
) -> dict[str, Any]:
    """Every draft model (name -> its HF folder and its exported GGUF) at every type in `types`, against the
    target GGUF's greedy answers to `prompts`; `calibration`: each draft's importance-matrix text (where the export
    used one); `margin`: choose_type's."""
    types = [check_quant(quant) for quant in types]
    if not prompts:
        raise SpectuneError("draft_types: no held-out prompts to measure the types on")
    start = time.perf_counter()
    target = LlamaModel(target_gguf, threads=threads)
    try:
        answered = target_answers(target, prompts, max_tokens)
    finally:
        target.close()
    target_weights = gguf_weights(target_gguf)  # read once: every draft's c is over the same target
    by_draft = {
        name: sweep_draft(
            name, folder, exported, target_weights, answered, types, (calibration or {}).get(name), threads, margin
        )
        for name, (folder, exported) in drafts.items()
    }
    return {
        "types": types,
        "type_margin": margin,
        "prompts": len(answered),
        "answer_tokens": sum(len(answer) for _, answer in answered),
        "seconds": round(time.perf_counter() - start, 1),
        "drafts": by_draft,
    }


def type_table(sweep: dict[str, Any]) -> list[str]:
    """The trade-off of every draft's types, as markdown: what each costs (bytes, c) and buys (α, τ, S at k, the best k
    on the card)."""
    lines = [
        f"### Draft types ({sweep['prompts']} prompts, {sweep['answer_tokens']} target tokens, {sweep['seconds']} s)",
        "",
        *(
            [f"A larger type, or the matrix over plain, wins only by more than {sweep['type_margin']:.0%}.", ""]
            if sweep.get("type_margin")
            else []
        ),
        "| draft | type | MB | α | α at 1/2/3 | c bytes / card | k | τ | predicted S: bytes / card (band) | |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in sweep["drafts"].items():
        for row in entry["types"]:
            by_position = "/".join(f"{row['alpha_by_position'].get(str(i), 0.0):.2f}" for i in (1, 2, 3))
            costs = " / ".join(
                f"{row['cost_ratio'][key]:.3f}" for key in (GPU_PROFILE, GROUNDED_PROFILE) if key in row["cost_ratio"]
            )
            k = row["chosen_by"]["k"]
            speedups = " / ".join(
                f"{row['speedup'][key][str(k)]:.2f}x"
                for key in (GPU_PROFILE, GROUNDED_PROFILE)
                if key in row["speedup"]
            )
            if row.get("card_band"):
                speedups += " ({:.2f}-{:.2f}x)".format(*row["card_band"])
            mark = "chosen" if row["label"] == entry["chosen"] else ""
            lines.append(
                f"| {name} | {row['label']} | {row['bytes'] / 1e6:.1f} | {row['alpha']:.1%} | {by_position} | {costs} "
                f"| {k} | {row['tau'][str(k)]:.2f} | {speedups} | {mark} |"
            )
    return lines
