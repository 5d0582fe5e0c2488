"""How tokens are picked and kept: the draft's token, and which proposals the target accepts, greedy (exactly the
target's own greedy output) or sampled (exactly the target's distribution: Leviathan et al.)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from spectune.runtime.decode import DecodeSettings


def probabilities(logits: np.ndarray, config: DecodeSettings) -> np.ndarray:
    """Softmax at the temperature after top-k and top-p, applied identically to target and draft."""
    # Shift before scaling: a tiny temperature then gives a one-hot distribution, never inf - inf = nan.
    with np.errstate(over="ignore"):  # -x / tiny = -inf: probability 0, as it should be
        scaled = (logits.astype(np.float64) - logits.max()) / config.temperature
    if 0 < config.top_k < scaled.size:
        cutoff = np.partition(scaled, -config.top_k)[-config.top_k]
        scaled = np.where(scaled < cutoff, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if config.top_p < 1.0:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < config.top_p
        filtered = np.zeros_like(probs)
        filtered[order[keep]] = probs[order[keep]]
        probs = filtered / filtered.sum()
    return probs


class Sampler(Protocol):
    """Picks the draft's tokens and decides which of them the target keeps."""

    def draft_token(self, logits: np.ndarray) -> tuple[int, float, np.ndarray | None]:
        """(token, the draft's confidence in it, the draft distribution it was sampled from, if any)."""
        ...

    def verify(self, rows: np.ndarray, drafts: list[int], draft_probs: list[np.ndarray]) -> tuple[int, int]:
        """(number of drafts accepted, the target's own next token) from the target's logits `rows`; `draft_probs`
        is empty for a proposal that was looked up, not sampled (an n-gram's: q is then one-hot)."""
        ...


class GreedySampler:
    def __init__(self, with_confidence: bool = False) -> None:
        self.with_confidence = with_confidence  # only draft_p_min needs the draft's top probability

    def draft_token(self, logits: np.ndarray) -> tuple[int, float, np.ndarray | None]:
        token = int(logits.argmax())
        if not self.with_confidence:
            return token, 1.0, None
        return token, float(1.0 / np.exp(logits - logits[token]).sum()), None

    def verify(self, rows: np.ndarray, drafts: list[int], draft_probs: list[np.ndarray]) -> tuple[int, int]:
        targets = rows.argmax(axis=1)  # one argmax over the whole batch, in numpy
        accepted = 0
        while accepted < len(drafts) and int(targets[accepted]) == drafts[accepted]:
            accepted += 1
        return accepted, int(targets[accepted])


class StochasticSampler:
    def __init__(self, config: DecodeSettings, rng: np.random.Generator) -> None:
        self.config, self.rng = config, rng

    def draft_token(self, logits: np.ndarray) -> tuple[int, float, np.ndarray | None]:
        probs = probabilities(logits, self.config)
        token = int(self.rng.choice(probs.size, p=probs))
        return token, float(probs[token]), probs

    def verify(self, rows: np.ndarray, drafts: list[int], draft_probs: list[np.ndarray]) -> tuple[int, int]:
        for index, token in enumerate(drafts):
            p = probabilities(rows[index], self.config)
            if draft_probs:
                q = draft_probs[index]
            else:
                q = np.zeros_like(p)
                q[token] = 1.0
            if self.rng.random() < min(1.0, p[token] / q[token]):
                continue
            residual = np.maximum(p - q, 0.0)
            total = residual.sum()
            residual = residual / total if total > 0 else p
            return index, int(self.rng.choice(residual.size, p=residual))
        p = probabilities(rows[len(drafts)], self.config)
        return len(drafts), int(self.rng.choice(p.size, p=p))


def make_sampler(config: DecodeSettings) -> Sampler:
    if config.temperature > 0:
        return StochasticSampler(config, np.random.default_rng(config.seed))
    return GreedySampler(with_confidence=config.draft_p_min > 0)
