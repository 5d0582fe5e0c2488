"""The draft model as a speculator: a small model of the target's family, greedy or sampled, with its own KV cache."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from spectune.runtime.llama import LlamaModel
from spectune.runtime.pair import check_pair
from spectune.runtime.sampling import Sampler
from spectune.runtime.speculators import Proposal

DRAFT = "draft"  # what a draft model's proposals are counted under, whatever the draft is called


class DraftModel:
    name = DRAFT

    def __init__(self, model: LlamaModel, target: LlamaModel) -> None:
        check_pair(target.path, model.path)  # llama.cpp's own pair rules; raises with the first mismatch
        self.model, self.is_end = model, target.is_end

    def behind(self, sequence: list[int]) -> int:
        return len(sequence) - self.model.reusable_prefix(sequence[:-1])

    def propose(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        """Up to k tokens; stops early at an end token or below `p_min` confidence."""
        start = time.perf_counter()
        common = self.model.reusable_prefix(sequence[:-1])  # always decode at least the last token
        logits = self.model.decode(sequence[common:], common, all_logits=False, copy=False)[-1]
        proposal = Proposal(source=DRAFT, caught_up=(len(sequence) - common, time.perf_counter() - start))

        def next_logits(token: int) -> np.ndarray:
            return self.model.decode([token], len(self.model.cached), all_logits=False, copy=False)[-1]

        return draft_chain(proposal, logits, next_logits, k, sampler, p_min, self.is_end)

    def verified(self, proposal: Proposal, accepted: int) -> None:
        """Nothing to learn: the next proposal rolls the cache back to what the target kept."""

    def forget(self) -> None:
        self.model.truncate(0)


def draft_chain(
    proposal: Proposal,
    logits: np.ndarray,
    next_logits: Callable[[int], np.ndarray],
    k: int,
    sampler: Sampler,
    p_min: float,
    is_end: Callable[[int], bool],
) -> Proposal:
    """A model's drafting: sample from `logits`, read the token (`next_logits`), again, up to k tokens; stops early
    at an end token (nothing after it is ever used) or below `p_min` confidence."""
    while True:
        token, confidence, probs = sampler.draft_token(logits)
        if confidence < p_min:
            return proposal
        proposal.tokens.append(token)
        if probs is not None:
            proposal.probs.append(probs)
        if len(proposal.tokens) == k or is_end(token):
            return proposal
        logits = next_logits(token)
