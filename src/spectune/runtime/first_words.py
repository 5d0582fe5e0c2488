"""How a caller's first words are decoded. The first token is always the target's own, from the prompt's prefill
(its last row), as without a draft (the draft reads the new turn after it); the first clause is drafted only where the
decoder's own measurements say that comes sooner than the target alone (`FirstWordsRule`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spectune.runtime.stats import Step
from spectune.speedup import first_sentence_ratio

# How the first clause is decoded: with the draft from the second token on, by the target alone (the draft reads the
# new turn after it), or whichever the decoder's own measurements say comes sooner.
FirstWords = Literal["auto", "draft", "alone"]


@dataclass
class FirstWordsRule:
    """What this decoder has measured of its own speed (moving averages of seconds), for choosing how a request's
    first clause is decoded: with the draft from the second token on, or by the target alone while the draft has
    not yet read the new turn (its catch-up then comes after the first clause, when the caller already hears it)."""

    alone: float | None = None  # a target step of one token
    speculative: float | None = None  # a speculative step's seconds per token it yields
    step_tokens: float = 1.0  # the tokens a speculative step yields (τ)
    catch_up: float | None = None  # the draft reading one token of a new turn (its prefill)
    clause_tokens: float = 8.0  # tokens to the first clause end

    @staticmethod
    def _average(old: float | None, new: float) -> float:
        return new if old is None else 0.8 * old + 0.2 * new

    def step(self, step: Step, catch_up: tuple[int, float] | None) -> None:
        seconds = step.draft_seconds + step.verify_seconds
        if not step.drafts and catch_up is None:
            self.alone = self._average(self.alone, seconds)
            return
        if catch_up is not None and catch_up[0] > 1:  # one token is any step's own input, not a catch-up
            self.catch_up = self._average(self.catch_up, catch_up[1] / catch_up[0])
            seconds -= catch_up[1]
        self.speculative = self._average(self.speculative, seconds / len(step.tokens))
        self.step_tokens = self._average(self.step_tokens, len(step.tokens))

    def clause(self, tokens: int) -> None:
        self.clause_tokens = self._average(self.clause_tokens, tokens)

    def draft_first_clause(self, behind: int) -> bool:
        """Whether the first clause comes sooner with the draft (which must first read `behind` tokens) than alone;
        True until each figure has been measured once. The clause with the draft is speedup.first_sentence_ratio's
        (the step that ends it is heard only once verified), the catch-up before it."""
        if self.alone is None or self.speculative is None or self.catch_up is None:
            return True
        clause_alone = self.clause_tokens * self.alone
        ratio = first_sentence_ratio(self.clause_tokens, self.step_tokens, self.alone / self.speculative)
        return behind * self.catch_up + ratio * clause_alone < clause_alone
