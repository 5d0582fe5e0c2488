"""The speculative draft -> verify loop on llama.cpp (after gpt-fast and llama.cpp's speculative-simple).

`speculative_step` is the whole algorithm: the drafter proposes up to k tokens after the last emitted one; the
target decodes that token and the proposals in one batch; the sampler keeps the longest acceptable prefix and adds
one token of the target's own (the correction, or a bonus when all k were accepted); the target's cache rolls back
to what was kept. `SpeculativeDecoder.generate` only drives it: prefill, end tokens, stop strings, statistics, and
the first words: the first token is the target's own step after the prefill, as without a draft (the draft reads
the new turn after it), and the first clause is drafted only where that comes sooner (`Pace`).

Greedy: a proposal is kept when it is the target's argmax, so the output is exactly the target's own greedy
output. Temperature > 0: proposal d ~ q is kept with probability min(1, p(d)/q(d)); a rejection is resampled
from norm(max(0, p − q)), so the output is distributed exactly as sampling the target alone (Leviathan et al.).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from spectune.errors import SpectuneError
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.ngram import NgramDrafter, NgramProposal
from spectune.runtime.pair import check_pair
from spectune.runtime.sampling import Sampler, make_sampler
from spectune.runtime.text import TextStream
from spectune.speedup import first_sentence_ratio

# How the first clause is decoded: with the draft from the second token on, by the target alone (the draft reads the
# new turn after it), or whichever the decoder's own measurements say comes sooner.
FirstWords = Literal["auto", "draft", "alone"]


class Drafter:
    """What proposes (llama.cpp's common_speculative): n-gram lookup first where it knows the continuation, else the
    draft model, which owns its KV cache. Either may be absent."""

    def __init__(
        self, model: LlamaModel | None, is_end: Callable[[int], bool], ngram: NgramDrafter | None = None
    ) -> None:
        self.model, self.is_end, self.ngram = model, is_end, ngram
        self.caught_up = (0, 0.0)  # (tokens, seconds) of the draft model's last catch-up on the sequence

    def behind(self, sequence: list[int]) -> int:
        """How many of `sequence`'s tokens the draft model's cache lacks (its catch-up before it can propose)."""
        return 0 if self.model is None else len(sequence) - self.model.reusable_prefix(sequence[:-1])

    def propose(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        """Up to k tokens; stops early at an end token or below `p_min` confidence (the draft model's)."""
        self.caught_up = (0, 0.0)
        if self.ngram is not None:
            looked_up = self.ngram.propose(sequence, k, self.is_end)
            if looked_up.tokens or self.model is None:
                return Proposal(looked_up.tokens, [], "ngram", looked_up)
        return self._propose_from_model(sequence, k, sampler, p_min)

    def verified(self, proposal: Proposal, accepted: int) -> None:
        """The target kept the proposal's first `accepted` tokens: the lookup learns how far to trust its tables."""
        if self.ngram is not None and proposal.lookup is not None:
            self.ngram.verified(proposal.lookup, accepted)

    def _propose_from_model(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        assert self.model is not None
        start = time.perf_counter()
        common = self.model.reusable_prefix(sequence[:-1])  # always decode at least the last token
        logits = self.model.decode(sequence[common:], common, all_logits=False, copy=False)[-1]
        self.caught_up = (len(sequence) - common, time.perf_counter() - start)
        proposal = Proposal([], [], "draft")
        while True:
            token, confidence, probs = sampler.draft_token(logits)
            if confidence < p_min:
                return proposal
            proposal.tokens.append(token)
            if probs is not None:
                proposal.probs.append(probs)
            if len(proposal.tokens) == k or self.is_end(token):  # nothing after an end token is ever used
                return proposal
            logits = self.model.decode([token], len(self.model.cached), all_logits=False, copy=False)[-1]


@dataclass
class Proposal:
    tokens: list[int]
    probs: list[np.ndarray]  # the draft distributions they were sampled from; empty when greedy or looked up
    source: Literal["draft", "ngram", ""]
    lookup: NgramProposal | None = None  # the n-gram's proposal, where it was looked up

    @property
    def from_context(self) -> int:
        """Tokens the conversation proposed (the rest: the domain table or the draft model)."""
        return self.lookup.from_context if self.lookup else 0


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


def speculative_step(
    target: LlamaModel,
    drafter: Drafter | None,
    sequence: list[int],
    k: int,
    sampler: Sampler,
    p_min: float = 0.0,
    no_end_rows: int = 0,
) -> Step:
    """Propose k, verify in one target batch, accept. `sequence`'s last token is not yet in the target's cache;
    the target may not end the answer at its first `no_end_rows` positions (min_tokens, ignore_eos)."""
    start = time.perf_counter()
    proposal = drafter.propose(sequence, k, sampler, p_min) if drafter and k > 0 else Proposal([], [], "")
    drafted = time.perf_counter()
    position, drafts = len(sequence) - 1, proposal.tokens
    rows = target.decode([sequence[-1], *drafts], position, all_logits=True, copy=False)  # read before any decode
    if no_end_rows:
        rows[:no_end_rows, target.end_tokens] = -np.inf
    accepted, own = sampler.verify(rows, drafts, proposal.probs)
    if drafter is not None:
        drafter.verified(proposal, accepted)
    target.truncate(position + 1 + accepted)  # keep the last token and the accepted drafts
    return Step(proposal, accepted, [*drafts[:accepted], own], drafted - start, time.perf_counter() - drafted)


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
    ngram_steps: int = 0  # steps whose proposal was looked up, not drafted by the model
    ngram_drafted: int = 0
    ngram_accepted: int = 0
    ngram_from_context: int = 0  # proposed tokens the conversation gave (the rest: the domain table)
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
        if step.proposal.source == "ngram":
            self.ngram_steps += 1
            self.ngram_drafted += len(step.drafts)
            self.ngram_accepted += step.accepted
            self.ngram_from_context += step.proposal.from_context
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
            acceptance_rate=self.acceptance_rate,
            mean_accepted_len=self.mean_accepted_len,
            tokens_per_second=self.tokens_per_second,
        )
        return out


@dataclass
class Generation:
    tokens: list[int]
    text: str  # exactly the concatenation of what was streamed
    stats: Stats


@dataclass
class Pace:
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


class SpeculativeDecoder:
    """Target alone (no draft nor n-gram, or draft_max 0), or target + draft model and/or n-gram lookup, one
    sequence at a time."""

    def __init__(self, target: LlamaModel, draft: LlamaModel | None = None, ngram: NgramDrafter | None = None) -> None:
        if draft is not None:
            check_pair(target.path, draft.path)  # llama.cpp's own pair rules; raises with the first mismatch
        self.target = target
        has_drafter = draft is not None or ngram is not None
        self.drafter = Drafter(draft, target.is_end, ngram) if has_drafter else None
        self.pace = Pace()
        self.progress = Stats()  # the running generation's statistics, as they grow (a server's live usage)

    def forget(self) -> None:
        """Drop both KV caches and what the lookup learned (the next prompt shares nothing with the previous one,
        e.g. another caller's)."""
        self.target.truncate(0)
        if self.drafter is not None and self.drafter.model is not None:
            self.drafter.model.truncate(0)
        if self.drafter is not None and self.drafter.ngram is not None:
            self.drafter.ngram.forget()

    def _prefill(self, prompt: list[int], stats: Stats, keep_going: Callable[[], bool]) -> bool:
        """Decode all but the prompt's last token, reusing the KV of a prefix a previous turn left; batch by
        batch, so a long prompt can be cancelled. False when it was."""
        if not prompt:
            raise SpectuneError("empty prompt")
        if len(prompt) >= self.target.n_ctx:
            raise SpectuneError(f"prompt of {len(prompt)} tokens does not fit the context of {self.target.n_ctx}")
        start = time.perf_counter()
        reused = self.target.reusable_prefix(prompt[:-1])
        self.target.truncate(reused)
        stats.prompt_tokens, stats.reused_prompt_tokens = len(prompt), reused
        for position in range(reused, len(prompt) - 1, self.target.n_batch):
            if not keep_going():
                return False
            end = min(position + self.target.n_batch, len(prompt) - 1)
            self.target.decode(prompt[position:end], position, all_logits=False)
        stats.prefill_seconds = time.perf_counter() - start
        return True

    def _first_clause_alone(self, prompt: list[int], config: DecodeSettings, first_words: FirstWords) -> bool:
        if self.drafter is None or config.k == 0 or first_words == "draft":
            return False
        return first_words == "alone" or not self.pace.draft_first_clause(self.drafter.behind(prompt))

    def _step(
        self, sequence: list[int], produced: int, k: int, config: DecodeSettings, sampler: Sampler, draft: bool
    ) -> tuple[Step, int]:
        """One step and the k it asked for; the target alone where `draft` is False."""
        room = self.target.n_ctx - len(sequence)  # positions left after the last token, for the proposals
        drafter = self.drafter if draft else None
        step_k = max(0, min(k, room - 1, config.max_tokens - produced - 1)) if drafter else 0
        no_end = config.max_tokens if config.ignore_eos else max(0, config.min_tokens - produced)
        step = speculative_step(
            self.target, drafter, sequence, step_k, sampler, config.draft_p_min, min(no_end, step_k + 1)
        )
        self.pace.step(step, drafter.caught_up if drafter and step_k else None)
        return step, step_k

    def generate(
        self,
        prompt: list[int],
        config: DecodeSettings,
        on_text: Callable[[str], bool] | None = None,
        first_words: FirstWords = "draft",
    ) -> Generation:
        """Generate after `prompt`. `on_text` gets the final text after every step (possibly empty); returning
        False stops the generation (finish reason "cancelled"). Neither model can be freed while it runs, not even
        at interpreter exit (logits are read in place, and the text is made from the model's vocabulary)."""
        draft_model = self.drafter.model if self.drafter else None
        draft_busy = draft_model.busy if draft_model else contextlib.nullcontext()
        with self.target.busy, draft_busy:
            return self._generate(prompt, config, on_text, first_words)

    def _generate(
        self,
        prompt: list[int],
        config: DecodeSettings,
        on_text: Callable[[str], bool] | None,
        first_words: FirstWords,
    ) -> Generation:
        begin = time.perf_counter()
        stats = self.progress = Stats()
        if not self._prefill(prompt, stats, lambda: on_text is None or on_text("") is not False):
            stats.finish_reason = "cancelled"
            return Generation([], "", stats)
        sampler = make_sampler(config)
        stream = TextStream(self.target, config.stop, config.min_tokens)
        sequence = list(prompt)  # every token so far; the last one is not yet in the target's cache
        output: list[int] = []
        k = config.k
        alone_until_clause = self._first_clause_alone(prompt, config, first_words)
        unsent = ""  # final text not yet handed to on_text
        while len(output) < config.max_tokens and len(sequence) < self.target.n_ctx:
            # The first token never waits for the draft; the first clause neither, where it comes sooner alone.
            draft = bool(output) and not alone_until_clause
            step, step_k = self._step(sequence, len(output), k, config, sampler, draft)
            caught_up = self.drafter.caught_up[0] if step.proposal.source == "draft" else 0
            if caught_up and stats.drafted == stats.ngram_drafted:  # the model's first one: what it found cached
                stats.draft_reused_prompt_tokens = len(sequence) - caught_up
            ended = next((i for i, token in enumerate(step.tokens) if self.target.is_end(token)), None)
            stats.record(step, ended, step_k, caught_up)
            if config.adaptive and step.drafts:
                k = min(config.k, k + 1) if step.accepted == len(step.drafts) else max(1, step.accepted + 1)
            new = step.tokens[:ended][: config.max_tokens - len(output)]
            output += new
            sequence += new
            stats.generated = len(output)
            if output and not stats.ttft_seconds:
                stats.ttft_seconds = time.perf_counter() - begin
            unsent = stream.add(new)
            if stream.first_clause_ended():
                alone_until_clause = False
                self.pace.clause(len(output))
            if ended is not None or stream.stopped:
                stats.finish_reason = "stop"
                break
            if on_text is not None and on_text(unsent) is False:
                stats.finish_reason = "cancelled"
                break
            unsent = ""
        unsent += stream.finish()
        if on_text is not None and unsent and stats.finish_reason != "cancelled":
            on_text(unsent)
        output = output[: stream.kept_tokens()]
        stats.generated = len(output)
        stats.total_seconds = time.perf_counter() - begin
        return Generation(output, stream.text, stats)
