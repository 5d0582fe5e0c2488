"""Drafts that cost nothing: continuations looked up, not computed (prompt lookup, llama.cpp's ngram speculators).

A voice bot's answers repeat what it was told (slot values from the caller's turns) and what it always says (the
same confirmations in the same words). Two tables of next-token counts after every n-gram propose such continuations:
the conversation so far (prompt and answer, updated as it grows), and a domain table built once from the tuned
target's own answers. A proposal chains lookups token by token, the longest matching n-gram first, the domain's
before the conversation's, and stops where neither has seen the tail, or, with `min_chance`, where the chance that
the whole proposal is kept falls below what one more verified token costs: on a CPU a batch of 2 costs 1.5-2 one-token
steps, so a guess pays only when it is likely. Each token's chance is its share of what followed its n-gram, scaled
by how often lookups like it (same source, same n) were kept, as this drafter has counted them. The target verifies
a proposal as it verifies a draft model's, so greedy answers stay the target's own.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pydantic import Field, model_validator

from spectune.config import Settings
from spectune.runtime.sampling import Sampler
from spectune.runtime.speculators import Proposal

NGRAM = "ngram"  # the n-gram lookup speculator's name


class NgramSettings(Settings):
    """Which n-gram sources propose, and how sure a lookup must be."""

    context: bool = Field(True, description="Look continuations up in the conversation so far.")
    domain: bool = Field(True, description="... and in the tuned target's own answers to the training dialogues.")
    min_n: int = Field(2, ge=1, le=8, description="Shortest tail that may match.")
    max_n: int = Field(6, ge=1, le=8, description="Longest tail tried first.")
    min_share: float = Field(
        0.5, gt=0, le=1, description="A domain continuation's least share of what followed its n-gram."
    )
    min_chance: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Propose a token only while the chance that it and those before it are all kept is at least "
        "this: what one more token costs the target's verification, in one-token steps (r(2) - 1, which the bench "
        "prints; about 0.5 on a 2-core CPU, near 0 on a GPU). 0: every token the tables know, up to k.",
    )

    @model_validator(mode="after")
    def _lengths(self) -> NgramSettings:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n {self.min_n} is above max_n {self.max_n}")
        return self


# Pseudo-counts behind a kind of lookup's kept/expected ratio before any were verified: a few verified tokens move it.
PRIOR_TOKENS = 4.0


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

    def lookup(self, tail: list[int], n: int, min_share: float) -> tuple[int, float] | None:
        """The most frequent token after the last n tokens of `tail`, when it is at least min_share of them, and
        its chance: count / (total + 1), one unseen continuation counted, so a tail seen once is a guess."""
        counts = self.following.get(tuple(tail[-n:])) if len(tail) >= n else None
        if not counts:
            return None
        token, count = counts.most_common(1)[0]
        total = counts.total()
        return (token, count / (total + 1)) if count >= min_share * total else None


Kind = tuple[bool, int]  # a lookup's kind: (the conversation proposed it, the n of the n-gram it matched)


@dataclass
class NgramProposal:
    tokens: list[int]
    from_context: int  # of them, how many the conversation proposed (the rest came from the domain table)
    evidence: list[tuple[Kind, float]] = field(default_factory=list)  # per token: its kind and table chance


def domain_table(settings: NgramSettings, answers: Iterable[list[int]]) -> NgramTable:
    """The domain table of these answers (empty where the settings turn the domain off); read-only once built, so
    one serves every slot of a server."""
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
        self.forget()

    def forget(self) -> None:
        """Start anew: no conversation, and no trust learned from one (it would tell of another caller's)."""
        self.context = NgramTable(self.settings.min_n, self.settings.max_n)
        self.indexed: list[int] = []  # the sequence the context table holds
        # Per kind of lookup, tokens kept and the sum of their table chances, over tokens the target verified
        # (those after a rejected one were never judged): how far the tables' chances are to be trusted.
        self.kept: Counter[Kind] = Counter()
        self.expected: Counter[Kind] = Counter()

    def _follow(self, sequence: list[int]) -> None:
        """Bring the context table up to `sequence`: extended where it continues the last one, else rebuilt."""
        if sequence[: len(self.indexed)] != self.indexed:
            self.context = NgramTable(self.settings.min_n, self.settings.max_n)
            self.indexed = []
        self.context.add(sequence, start=len(self.indexed))
        self.indexed = list(sequence)

    def _next(self, tail: list[int]) -> tuple[int, Kind, float] | None:
        """The next token, its kind and its table chance; None where no source knows the tail."""
        for n in range(self.settings.max_n, self.settings.min_n - 1, -1):
            # The target's own phrasing first: on the demo pair its first token was the target's next on 94% of
            # its proposals, the conversation's on 43% (benchmarks/ngram_sources.py)
            found = self.domain.lookup(tail, n, self.settings.min_share)
            if found is not None:
                return found[0], (False, n), found[1]
            found = self.context.lookup(tail, n, min_share=0.0) if self.settings.context else None
            if found is not None:
                return found[0], (True, n), found[1]
        return None

    def chance(self, kind: Kind, table_chance: float) -> float:
        """The chance that a token the tables give `table_chance` is kept, as lookups of its kind have fared."""
        trust = (self.kept[kind] + PRIOR_TOKENS) / (self.expected[kind] + PRIOR_TOKENS)
        return min(1.0, table_chance * trust)

    def propose(self, sequence: list[int], k: int, is_end: Callable[[int], bool]) -> NgramProposal:
        """Up to k tokens after `sequence`; stops at the first end token (`is_end(token)`), an unknown tail, or
        where the whole proposal's chance falls below min_chance."""
        if self.settings.context:
            self._follow(sequence)
        tail = sequence[-self.settings.max_n :]
        proposal = NgramProposal([], 0)
        whole_chance = 1.0
        while len(proposal.tokens) < k:
            found = self._next(tail)
            if found is None:
                break
            token, kind, table_chance = found
            whole_chance *= self.chance(kind, table_chance)
            if whole_chance < self.settings.min_chance:
                break
            proposal.tokens.append(token)
            proposal.from_context += kind[0]
            proposal.evidence.append((kind, table_chance))
            if is_end(token):
                break
            tail = [*tail[1:], token]
        return proposal

    def verified(self, proposal: NgramProposal, accepted: int) -> None:
        """Count how the target judged a proposal: its first `accepted` tokens kept, the next one not."""
        for index, (kind, table_chance) in enumerate(proposal.evidence[: accepted + 1]):
            self.kept[kind] += index < accepted
            self.expected[kind] += table_chance


@dataclass(frozen=True)
class NgramSetup:
    """What a verb gives n-gram lookup: its settings and the domain table (built once, read by every instance)."""

    settings: NgramSettings
    domain: NgramTable | None = None


class NgramSpeculator:
    """n-gram lookup as a speculator (runtime/speculators.py); its conversation table is its own."""

    name = NGRAM
    model = None

    def __init__(self, setup: NgramSetup, is_end: Callable[[int], bool]) -> None:
        self.drafter, self.is_end = NgramDrafter(setup.settings, setup.domain), is_end

    def propose(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        looked_up = self.drafter.propose(sequence, k, self.is_end)
        return Proposal(looked_up.tokens, source=NGRAM, from_context=looked_up.from_context, evidence=looked_up)

    def verified(self, proposal: Proposal, accepted: int) -> None:
        assert isinstance(proposal.evidence, NgramProposal)
        self.drafter.verified(proposal.evidence, accepted)

    def behind(self, sequence: list[int]) -> int:
        return 0

    def forget(self) -> None:
        self.drafter.forget()
