"""What proposes tokens for the target to verify: the `Speculator` protocol, its `Proposal`, and the ordered list the
loop asks, as llama.cpp's common/speculative.cpp holds its speculators: the first that proposes wins, each owns its
state (a KV cache, the conversation it has read).

A speculator only proposes: the target verifies every proposal the same way, so greedy answers stay the target's
own whatever proposes. Adding one is a module with a class that has these four methods and a line in
`runtime/registry.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from spectune.runtime.llama import LlamaModel
from spectune.runtime.sampling import Sampler


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)  # the distributions sampled from; empty: greedy, looked up
    source: str = ""  # the name of the speculator that proposed them ("": nothing was asked)
    from_context: int = 0  # of the tokens, how many the conversation itself gave (n-gram lookup)
    caught_up: tuple[int, float] = (0, 0.0)  # (tokens, seconds) a model read before it proposed
    evidence: object = None  # the speculator's own notes, handed back to it with the target's verdict


class Speculator(Protocol):
    """Proposes continuations of a sequence and learns how the target judged them."""

    name: str  # what its proposals are counted under (Stats.by_source, a bench's `NAME_*` figures)
    model: LlamaModel | None  # the model it runs, held busy while it decodes and closed with it; None: a lookup

    def propose(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        """Up to k tokens after `sequence` (its last token not yet in the target's cache); none where it has no
        guess. `p_min`: a model's least confidence to go on drafting."""
        ...

    def verified(self, proposal: Proposal, accepted: int) -> None:
        """The target kept the first `accepted` tokens of this speculator's `proposal`."""
        ...

    def behind(self, sequence: list[int]) -> int:
        """Tokens of `sequence` it must still read before it can propose (a model's catch-up; 0 for a lookup)."""
        ...

    def forget(self) -> None:
        """Drop everything it holds of the conversation (the next one may be another caller's)."""
        ...


class Speculators:
    """The ordered list the loop asks: the first non-empty proposal wins; where none proposes, the last one's empty
    proposal stands (its catch-up, if it read any, still counted)."""

    def __init__(self, members: list[Speculator]) -> None:
        self.members = members

    def __bool__(self) -> bool:
        return bool(self.members)

    @property
    def models(self) -> list[LlamaModel]:
        return [member.model for member in self.members if member.model is not None]

    def propose(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        proposal = Proposal()
        for member in self.members:
            proposal = member.propose(sequence, k, sampler, p_min)
            if proposal.tokens:
                break
        return proposal

    def verified(self, proposal: Proposal, accepted: int) -> None:
        for member in self.members:
            if member.name == proposal.source:
                member.verified(proposal, accepted)

    def behind(self, sequence: list[int]) -> int:
        return sum(member.behind(sequence) for member in self.members)

    def forget(self) -> None:
        for member in self.members:
            member.forget()
