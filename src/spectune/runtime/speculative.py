"""The speculative draft -> verify loop on llama.cpp (after gpt-fast and llama.cpp's speculative-simple).

`speculative_step` is the whole algorithm: the speculators propose up to k tokens after the last emitted one; the
target decodes that token and the proposals in one batch; the sampler keeps the longest acceptable prefix and adds
one token of the target's own (the correction, or a bonus when all k were accepted); the target's cache rolls back
to what was kept. `SpeculativeDecoder.generate` only drives it: prefill, end tokens, stop strings, statistics, and
the first words: the first token is the target's own, from the prefill's last row (one pass, as llama-server's;
the draft reads the new turn after it), and the first clause is drafted only where that comes sooner (`FirstWordsRule`).

Greedy: a proposal is kept when it is the target's argmax, so the output is exactly the target's own greedy
output. Temperature > 0: proposal d ~ q is kept with probability min(1, p(d)/q(d)); a rejection is resampled
from norm(max(0, p − q)), so the output is distributed exactly as sampling the target alone (Leviathan et al.).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from spectune.errors import SpectuneError
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DRAFT
from spectune.runtime.first_words import FirstWords, FirstWordsRule
from spectune.runtime.llama import DecodeAborted, LlamaModel
from spectune.runtime.sampling import Sampler, make_sampler
from spectune.runtime.speculators import Proposal, Speculator, Speculators
from spectune.runtime.stats import Stats, Step
from spectune.runtime.text import TextStream


def speculative_step(
    target: LlamaModel,
    speculators: Speculators | None,
    sequence: list[int],
    k: int,
    sampler: Sampler,
    p_min: float = 0.0,
    no_end_rows: int = 0,
    prefilled: np.ndarray | None = None,
) -> Step:
    """Propose k, verify in one target batch, accept. `sequence`'s last token is not yet in the target's cache,
    unless the prefill decoded it and `prefilled` holds its logits (the first step, which drafts nothing); the
    target may not end the answer at its first `no_end_rows` positions (min_tokens, ignore_eos)."""
    start = time.perf_counter()
    proposal = speculators.propose(sequence, k, sampler, p_min) if speculators and k > 0 else Proposal()
    drafted = time.perf_counter()
    position, drafts = len(sequence) - 1, proposal.tokens
    if prefilled is not None and not drafts:
        rows = prefilled[None, :]
    else:  # the logits are read before any other decode
        rows = target.decode([sequence[-1], *drafts], position, all_logits=True, copy=False)
    if no_end_rows:
        rows[:no_end_rows, target.end_tokens] = -np.inf
    accepted, own = sampler.verify(rows, drafts, proposal.probs)
    if speculators:
        speculators.verified(proposal, accepted)
    target.truncate(position + 1 + accepted)  # keep the last token and the accepted drafts
    return Step(proposal, accepted, [*drafts[:accepted], own], drafted - start, time.perf_counter() - drafted)


# (length, call): call once the target's cache holds the prompt's first `length` tokens (a server saves a shared
# prefix there); None: nothing to call
Checkpoint = tuple[int, Callable[[], None]] | None


@dataclass
class Generation:
    tokens: list[int]
    text: str  # exactly the concatenation of what was streamed
    stats: Stats


class SpeculativeDecoder:
    """The target alone (no speculator, or draft_max 0), or the target with its speculators in order (a draft model,
    n-gram lookup, ...: runtime/registry.py), one sequence at a time."""

    def __init__(self, target: LlamaModel, speculators: list[Speculator] | None = None) -> None:
        self.target = target
        self.speculators = Speculators(speculators or [])
        self.first_words_rule = FirstWordsRule()
        self.progress = Stats()  # the running generation's statistics, as they grow (a server's live usage)

    @property
    def models(self) -> list[LlamaModel]:
        """The target, then every speculator's model."""
        return [self.target, *self.speculators.models]

    def abort(self) -> None:
        """From any thread: cut the decode in progress in every model (the generation ends "cancelled"); no model
        decodes again. For a server that is stopping."""
        for model in self.models:
            model.abort()

    def interrupt(self, cut: bool) -> None:
        """From any thread: cut (True) or allow again (False) every model's decoding (LlamaModel.interrupt)."""
        for model in self.models:
            model.interrupt(cut)

    def forget(self) -> None:
        """Drop both KV caches and what the lookup learned (the next prompt shares nothing with the previous one,
        e.g. another caller's)."""
        self.target.truncate(0)
        self.speculators.forget()

    def extend(self, tokens: list[int], keep_going: Callable[[], bool] = lambda: True) -> tuple[int, np.ndarray] | None:
        """Bring the target's cache to exactly `tokens`, reusing the prefix it holds (all but the last token, whose
        logits it returns), a batch at a time so that it can be cancelled between batches (or within one:
        interrupt). (Tokens reused, the last token's logits); None when cancelled (what was decoded stays cached)."""
        reused = min(self.target.reusable_prefix(tokens), len(tokens) - 1)
        self.target.truncate(reused)
        size = self.target.n_batch
        logits = np.empty(0)
        for position in range(reused, len(tokens), size):
            if not keep_going():
                return None
            try:
                logits = self.target.decode(tokens[position : position + size], position, all_logits=False)
            except DecodeAborted:  # the server is stopping, or a caller needs the slot: cut inside the batch
                return None
        return reused, logits[-1]

    def prefill(
        self,
        prompt: list[int],
        stats: Stats,
        keep_going: Callable[[], bool] = lambda: True,
        checkpoint: Checkpoint = None,
    ) -> np.ndarray | None:
        """Decode the prompt, reusing the KV of a prefix a previous turn left, batch by batch (`extend`), so a
        long prompt can be cancelled: the logits of its last token (the first token comes from them in the same
        pass, as llama-server's does); None when cancelled. `checkpoint`: (length, call) to call once the cache
        holds the prompt's first `length` tokens, where the prefill passes that length."""
        if not prompt:
            raise SpectuneError("empty prompt")
        if len(prompt) >= self.target.n_ctx:
            raise SpectuneError(f"prompt of {len(prompt)} tokens does not fit the context of {self.target.n_ctx}")
        start = time.perf_counter()
        stats.prompt_tokens = len(prompt)
        stats.reused_prompt_tokens = min(self.target.reusable_prefix(prompt), len(prompt) - 1)
        length, call = checkpoint or (0, None)
        if call is not None and stats.reused_prompt_tokens < length < len(prompt) - 1:
            if self.extend(prompt[:length], keep_going) is None:
                return None
            call()
        if (decoded := self.extend(prompt, keep_going)) is None:
            return None
        stats.prefill_seconds = time.perf_counter() - start
        return decoded[1]

    def _first_clause_alone(self, prompt: list[int], config: DecodeSettings, first_words: FirstWords) -> bool:
        if not self.speculators or config.k == 0 or first_words == "draft":
            return False
        return first_words == "alone" or not self.first_words_rule.draft_first_clause(self.speculators.behind(prompt))

    def _step(
        self,
        sequence: list[int],
        produced: int,
        k: int,
        config: DecodeSettings,
        sampler: Sampler,
        draft: bool,
        prefilled: np.ndarray | None,
    ) -> tuple[Step, int]:
        """One step and the k it asked for; the target alone where `draft` is False (and with the logits the
        prefill left of the last token, where it did)."""
        room = self.target.n_ctx - len(sequence)  # positions left after the last token, for the proposals
        speculators = self.speculators if draft and self.speculators else None
        step_k = max(0, min(k, room - 1, config.max_tokens - produced - 1)) if speculators else 0
        no_end = config.max_tokens if config.ignore_eos else max(0, config.min_tokens - produced)
        no_end_rows = min(no_end, step_k + 1)
        step = speculative_step(
            self.target, speculators, sequence, step_k, sampler, config.draft_p_min, no_end_rows, prefilled
        )
        self.first_words_rule.step(step, step.proposal.caught_up if speculators and step_k else None)
        return step, step_k

    def generate(
        self,
        prompt: list[int],
        config: DecodeSettings,
        on_text: Callable[[str], bool] | None = None,
        first_words: FirstWords = "draft",
        checkpoint: Checkpoint = None,
    ) -> Generation:
        """Generate after `prompt`. `on_text` gets the final text after every step (possibly empty); returning
        False stops the generation (finish reason "cancelled"); `checkpoint` is called during the prefill. Neither
        model can be freed while it runs, not even at interpreter exit (logits are read in place, and the text is
        made from the model's vocabulary)."""
        with contextlib.ExitStack() as busy:
            for model in self.models:
                busy.enter_context(model.busy)
            return self._generate(prompt, config, on_text, first_words, checkpoint)

    def _generate(
        self,
        prompt: list[int],
        config: DecodeSettings,
        on_text: Callable[[str], bool] | None,
        first_words: FirstWords,
        checkpoint: Checkpoint,
    ) -> Generation:
        begin = time.perf_counter()
        stats = self.progress = Stats()
        prefilled = self.prefill(prompt, stats, lambda: on_text is None or on_text("") is not False, checkpoint)
        if prefilled is None:
            stats.finish_reason = "cancelled"
            return Generation([], "", stats)
        sampler = make_sampler(config)
        stream = TextStream(self.target, config.stop, config.min_tokens)
        sequence, k = list(prompt), config.k  # every token so far, and the draft length
        output: list[int] = []
        alone_until_clause = self._first_clause_alone(prompt, config, first_words)
        unsent = ""  # final text not yet handed to on_text
        while len(output) < config.max_tokens and len(sequence) < self.target.n_ctx:
            # The first token never waits for the draft; the first clause neither, where it comes sooner alone.
            draft = bool(output) and not alone_until_clause
            try:
                first = prefilled if not output else None  # the first step's logits came with the prefill
                step, step_k = self._step(sequence, len(output), k, config, sampler, draft, first)
            except DecodeAborted:  # the server is stopping (abort): the answer so far, cancelled
                stats.finish_reason = "cancelled"
                break
            caught_up = step.proposal.caught_up[0]
            if caught_up and DRAFT not in stats.by_source:  # the model's first proposal: what it found cached
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
                self.first_words_rule.clause(len(output))
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
