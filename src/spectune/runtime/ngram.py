"""Drafts that cost nothing: continuations looked up, not computed (prompt lookup, llama.cpp's ngram speculators).

A voice bot's answers repeat what it was told (slot values from the caller's turns) and what it always says (the
same confirmations in the same words). Two tables of next-token counts after every n-gram propose such continuations:
the conversation so far (prompt and answer, updated as it grows), and a domain table built once from the tuned
target's own answers. A proposal chains lookups token by token, the longest matching n-gram first, the domain's
before the conversation's, and stops where neither has seen the tail. The target verifies it as it verifies a
draft model's proposal, so greedy answers stay the target's own.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import Field

from spectune.config import Settings

NGRAM = "ngram"  # the n-gram variants: `ngram` alone, `ngram+DRAFT` in front of a draft model


class NgramSettings(Settings):
    """Which n-gram sources propose, and how sure a lookup must be."""

    context: bool = Field(True, description="Look continuations up in the conversation so far.")
    domain: bool = Field(True, description="... and in the tuned target's own answers to the training dialogues.")
    min_n: int = Field(2, ge=1, le=8, description="Shortest tail that may match.")
    max_n: int = Field(6, ge=1, le=8, description="Longest tail tried first.")
    min_share: float = Field(
        0.5, gt=0, le=1, description="A domain continuation's least share of what followed its n-gram."
    )


class NgramTable:
    """How often each token followed each n-gram (min_n <= n <= max_n) of some token sequences."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.following: defaultdict[tuple[int, ...], Counter[int]] = defaultdict(Counter)

    def add(self, tokens: list[int], start: int = 0) -> None:
        """Count the tokens at positions >= start after the n-grams ending just before them."""
        for end in range(max(start, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.following[tuple(tokens[end - n : end])][tokens[end]] += 1

    def lookup(self, tail: list[int], n: int, min_share: float) -> int | None:
        """The most frequent token after the last n tokens of `tail`, when it is at least min_share of them."""
        counts = self.following.get(tuple(tail[-n:])) if len(tail) >= n else None
        if not counts:
            return None
        token, count = counts.most_common(1)[0]
        return token if count >= min_share * counts.total() else None


@dataclass
class NgramProposal:
    tokens: list[int]
    from_context: int  # of them, how many the conversation proposed (the rest came from the domain table)


def domain_table(settings: NgramSettings, answers: Iterable[list[int]]) -> NgramTable:
    """The domain table of these answers (empty where the settings turn the domain off); read-only once built, so
    one serves every slot of a server."""
    if settings.min_n > settings.max_n:
        raise ValueError(f"ngram min_n {settings.min_n} is above max_n {settings.max_n}")
    table = NgramTable(settings.min_n, settings.max_n)
    for answer in answers if settings.domain else ():
        table.add(answer)
    return table


def domain_of_texts(
    settings: NgramSettings, texts: Iterable[str], tokenize: Callable[[str, bool], list[int]]
) -> NgramTable:
    """The domain table of answers given as text, tokenized as the target tokenizes them (no special tokens)."""
    return domain_table(settings, (tokenize(text, False) for text in texts))


class NgramDrafter:
    """Proposes up to k tokens after a sequence from the conversation's table and the domain table. The
    conversation's table is its own: a sequence that does not continue the last one (another caller) starts it
    anew."""

    def __init__(self, settings: NgramSettings, domain: NgramTable | None = None) -> None:
        self.settings = settings
        self.domain = domain if domain is not None else domain_table(settings, [])
        self.context = NgramTable(settings.min_n, settings.max_n)
        self.indexed: list[int] = []  # the sequence the context table holds

    def _follow(self, sequence: list[int]) -> None:
        """Bring the context table up to `sequence`: extended where it continues the last one, else rebuilt."""
        if sequence[: len(self.indexed)] != self.indexed:
            self.context = NgramTable(self.settings.min_n, self.settings.max_n)
            self.indexed = []
        self.context.add(sequence, start=len(self.indexed))
        self.indexed = list(sequence)

    def _next(self, tail: list[int]) -> tuple[int | None, bool]:
        """The next token (None: no source knows the tail) and whether the conversation proposed it."""
        for n in range(self.settings.max_n, self.settings.min_n - 1, -1):
            # The target's own phrasing first: on the demo pair its first token was the target's next on 94% of
            # its proposals, the conversation's on 43% (benchmarks/ngram_sources.py)
            token = self.domain.lookup(tail, n, self.settings.min_share)
            if token is not None:
                return token, False
            if self.settings.context:
                token = self.context.lookup(tail, n, min_share=0.0)
                if token is not None:
                    return token, True
        return None, False

    def propose(self, sequence: list[int], k: int, is_end: Callable[[int], bool]) -> NgramProposal:
        """Up to k tokens after `sequence`; stops at the first end token (`is_end(token)`) or unknown tail."""
        if self.settings.context:
            self._follow(sequence)
        tail = sequence[-self.settings.max_n :]
        proposal = NgramProposal([], 0)
        while len(proposal.tokens) < k:
            token, from_context = self._next(tail)
            if token is None:
                break
            proposal.tokens.append(token)
            proposal.from_context += from_context
            if is_end(token):
                break
            tail = [*tail[1:], token]
        return proposal
