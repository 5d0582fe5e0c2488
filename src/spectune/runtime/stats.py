"""What one speculative step did, and what a generation's steps add up to (llama.cpp's counters, and more)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from spectune.runtime.speculators import Proposal


@dataclass
class Step:
    proposal: Proposal
    accepted: int
    tokens: list[int]  # the accepted drafts and the target's own token
    draft_seconds: float
    verify_seconds: float

    @property
    def drafts(self) -> list[int]:
        return self.proposal.tokens


@dataclass
class SourceCounts:
    """One speculator's share of a generation's steps."""

    steps: int = 0  # steps whose proposal it made (an empty one counted where nothing else proposed)
    drafted: int = 0
    accepted: int = 0
    from_context: int = 0  # proposed tokens the conversation gave (n-gram lookup; the rest: its domain table)


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt tokens whose KV a previous turn left in the cache
    draft_reused_prompt_tokens: int = 0  # the same in the draft's cache, at its first proposal
    generated: int = 0
    produced: int = 0  # tokens the verify steps yielded, the end token included (τ counts it)
    drafted: int = 0
    accepted: int = 0
    # As llama.cpp's llama-speculative-simple counts: k drafted per step (it drafts on past an end token), and an
    # accepted end token before the k-th draft counted as the target's own token, not as accepted.
    offered: int = 0
    accepted_as_llama_cpp: int = 0
    # Per speculator that proposed (its name): steps, drafted, accepted, and tokens the conversation gave
    by_source: dict[str, SourceCounts] = field(default_factory=dict)
    verify_steps: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    # Where the draft model read more than one token in a batch before proposing (tokens it had not drafted itself:
    # looked up, its last proposal and the bonus, a new turn): how many, one entry a time.
    draft_catch_ups: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str = "length"

    def record(self, step: Step, ended: int | None, offered: int, caught_up: int = 0) -> None:
        """One step; `ended`: the index of the first end token in its tokens; `offered`: the k it was asked for;
        `caught_up`: the tokens the draft model read before proposing."""
        self.verify_steps += 1
        if caught_up > 1:
            self.draft_catch_ups.append(caught_up)
        self.produced += len(step.tokens) if ended is None else ended + 1  # τ counts the end token
        self.drafted += len(step.drafts)
        self.offered += offered
        end_accepted_early = ended is not None and ended < step.accepted and ended + 1 < offered
        self.accepted_as_llama_cpp += step.accepted - end_accepted_early
        self.accepted += step.accepted
        if step.proposal.source:
            counts = self.by_source.setdefault(step.proposal.source, SourceCounts())
            counts.steps += 1
            counts.drafted += len(step.drafts)
            counts.accepted += step.accepted
            counts.from_context += step.proposal.from_context
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds
        missing = len(step.drafts) - len(self.drafted_at)
        self.drafted_at += [0] * missing
        self.accepted_at += [0] * missing
        for index in range(len(step.drafts)):
            self.drafted_at[index] += 1
            self.accepted_at[index] += int(index < step.accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """τ: tokens yielded per target verify step."""
        return self.produced / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        decode = self.total_seconds - self.prefill_seconds
        return self.generated / decode if decode > 0 else 0.0

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out.update(
            by_source={name: dataclasses.asdict(counts) for name, counts in self.by_source.items()},
            acceptance_rate=self.acceptance_rate,
            mean_accepted_len=self.mean_accepted_len,
            tokens_per_second=self.tokens_per_second,
        )
        return out
