"""The theory the bench speaks in (Leviathan et al. 2023).

With per-token acceptance α and draft length k, a verify step yields τ(k) = (1 − α^(k+1)) / (1 − α) tokens on
average. One step costs r(k+1) target steps for verification plus k draft steps of c each, so the speedup over
plain decoding is S(k) = τ(k) / (r(k+1) + k·c). On a memory-bound GPU r ≈ 1 and S = τ / (1 + k·c).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GPU_VERIFY_RATIO = 1.0  # memory-bound decoding: k+1 tokens cost what one does
MAX_DRAFT_LEN = 8  # the longest k the acceptance meter considers
Q4_K_M_BITS = 4.85  # llama.cpp's Q4_K_M stores about this many bits a weight, on average over a model
DEFAULT_DRAFT_MAX = MAX_DRAFT_LEN  # k where no measured recommendation exists
GPU_PROFILE = "gpu"  # the memory-bound GPU profile, whose best k is each draft's recommended k


@dataclass(frozen=True)
class Weights:
    """A model's weights as one decode step sees them, in bytes (a GGUF) or elements (HF weights at one width)."""

    total: int  # every weight tensor once (a tied head and embedding are one table)
    embedding: int  # the token-embedding table
    rows: int  # its rows: the vocabulary
    tied: bool  # the head is the embedding table
    layers: int = 0  # decoder layers, each a floor of kernel launches on a GPU (spectune.gpu)

    def step_read(self) -> float:
        """What one decode step reads: every weight, but one row of the embedding table, which a lookup reads,
        unless the head is that table, which reads all of it."""
        return self.total + self.embedding / self.rows - (0 if self.tied else self.embedding)


def step_cost_ratio(draft: Weights, target: Weights) -> float:
    """c on a memory-bound GPU, the one every prediction and k choice uses: what a draft step reads over what a
    target step reads (the file-size ratio overstates a draft whose embedding table is a large share of it)."""
    return draft.step_read() / target.step_read()


def expected_tokens(alpha: float, k: int) -> float:
    """τ(k): expected tokens per verify step with i.i.d. acceptance α and k drafted tokens."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(tau: float, k: int, cost_ratio: float, verify_ratio: float = GPU_VERIFY_RATIO) -> float:
    """S = τ / (r(k+1) + k·c)."""
    return tau / (verify_ratio + k * cost_ratio)


def pooled_by_position(rows: list[dict[str, Any]], key: str) -> list[int]:
    """A per-draft-position count (a bench row's drafted_at or accepted_at) summed over the prompts."""
    positions = max((len(row[key]) for row in rows), default=0)
    return [sum(row[key][i] for row in rows if i < len(row[key])) for i in range(positions)]


def steps_of(rows: list[dict[str, Any]]) -> tuple[list[int], int] | None:
    """The steps a bench made for one variant over its prompts' rows: (drafted_at pooled, verify steps), the input
    of speedup_of_steps; None where the rows do not record them (older results)."""
    if not rows or any("drafted_at" not in row for row in rows):
        return None
    return pooled_by_position(rows, "drafted_at"), sum(row["verify_steps"] for row in rows)


def speedup_of_steps(
    tau: float,
    drafted_at: list[int],
    steps: int,
    cost_ratio: float,
    profile: Mapping[str, float] | None,
    extra_cost: float = 0.0,
) -> float:
    """S = τ / mean over verify steps of (r(d+1) + d·c), with d the tokens each step really drafted: a draft stops
    at an end token and an answer's last step drafts no further than its token limit, so on short answers d is
    often below k. `drafted_at[i]`: the steps that drafted at least i + 1 tokens (None profile: r = 1);
    `extra_cost`: what else the steps cost in all, in target steps (the draft's catch-up batches)."""
    if not steps:
        return 0.0
    counts = [*drafted_at, 0]
    by_length = {0: steps - counts[0]}
    by_length |= {d: counts[d - 1] - counts[d] for d in range(1, len(counts))}
    cost = sum(n * (verify_ratio_at(profile, d + 1) + d * cost_ratio) for d, n in by_length.items()) + extra_cost
    return tau * steps / cost


def first_sentence_ratio(clause_tokens: float, tau: float, speedup: float) -> float:
    """Time to the first sentence with speculation over the target alone's, the prompt cached, the clause
    `clause_tokens` long. Its first token is the target's own step either way (the loop never drafts it); the
    others come in verify steps of τ tokens at `speedup` times the target alone's pace, and the step that ends the
    clause runs on average (τ − 1) / 2 tokens past its end (a caller hears nothing until the step is verified)."""
    later = clause_tokens - 1.0
    past_end = (tau - 1.0) / 2.0 if later > 0 else 0.0
    return (1.0 + (later + past_end) / speedup) / clause_tokens


def verify_ratio_between(profile: Mapping[str, float] | None, tokens: float) -> float:
    """r at a fractional batch size (a mean over steps: d + 1 tokens, d the mean drafted), linear between the
    profile's integer sizes (r(1) = 1); 1.0 with no profile."""
    if not profile:
        return 1.0
    ratios = {1: 1.0} | {int(n): r for n, r in profile.items()}
    low = min(max(int(tokens), 1), max(ratios) - 1)
    return ratios[low] + (ratios[low + 1] - ratios[low]) * (tokens - low)


def verify_ratio_at(profile: Mapping[str, float] | None, n: int) -> float:
    """r(n) from a measured profile ({"2": r2, ...}); 1.0 for n = 1 or no profile (the GPU assumption)."""
    if n <= 1 or not profile:
        return 1.0
    known = sorted(int(key) for key in profile)
    return float(profile[str(min(known, key=lambda m: abs(m - n)))])
