"""The speculative draft -> verify loop on llama.cpp (after gpt-fast and llama.cpp's speculative-simple).

Each step: the draft proposes up to k tokens after the last emitted one; the target decodes that token and the
proposals in one batch; the longest agreeing prefix is kept and the target adds one token of its own (the
correction, or a bonus when all k were accepted); both KV caches roll back to what was kept.

Greedy: a proposal is kept when it is the target's argmax, so the output is exactly the target's own greedy
output. Temperature > 0: proposal d ~ q is kept with probability min(1, p(d)/q(d)); a rejection is resampled
from norm(max(0, p − q)), so the output is distributed exactly as sampling the target alone (Leviathan et al.).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from spectune.errors import SpectuneError
from spectune.runtime.llama import LlamaModel


@dataclass
class SamplingConfig:
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    draft_max: int = 8  # k; 0 disables drafting
    draft_p_min: float = 0.0  # stop drafting when the draft's top probability falls below this
    adaptive: bool = False  # grow k after a fully accepted step, shrink it after an early rejection


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt tokens whose KV a previous turn left in the cache
    generated: int = 0
    produced: int = 0  # tokens the verify steps yielded, the end token included (τ counts it)
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str = "length"

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


def probabilities(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """Softmax at the temperature after top-k and top-p, applied identically to target and draft."""
    scaled = logits.astype(np.float64) / config.temperature
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


class SpeculativeDecoder:
    """Target alone (draft None or draft_max 0) or target + draft, one sequence at a time."""

    def __init__(self, target: LlamaModel, draft: LlamaModel | None = None) -> None:
        if draft is not None:
            from spectune.export.pair import check_pair

            check_pair(target.path, draft.path)  # llama.cpp's own pair rules; raises with the first mismatch
        self.target, self.draft = target, draft

    def _sync_draft(self, sequence: list[int]) -> np.ndarray:
        """Bring the draft's cache to `sequence` (reusing the common prefix); return its next-token logits."""
        assert self.draft is not None
        common = self.draft.reusable_prefix(sequence[:-1])  # always decode at least the last token
        return self.draft.decode(sequence[common:], common, all_logits=False)[-1]

    def _propose(
        self, sequence: list[int], k: int, config: SamplingConfig, rng: np.random.Generator, stats: Stats
    ) -> tuple[list[int], list[np.ndarray]]:
        drafts: list[int] = []
        draft_probs: list[np.ndarray] = []
        if self.draft is None or k == 0:
            return drafts, draft_probs
        start = time.perf_counter()
        logits = self._sync_draft(sequence)
        for _ in range(k):
            if config.temperature > 0:
                probs = probabilities(logits, config)
                token = int(rng.choice(probs.size, p=probs))
                confidence = probs[token]
                draft_probs.append(probs)
            else:
                token = int(logits.argmax())
                if config.draft_p_min > 0:
                    shifted = np.exp(logits - logits.max())
                    confidence = 1.0 / shifted.sum()
                else:
                    confidence = 1.0
            if confidence < config.draft_p_min:
                draft_probs = draft_probs[: len(drafts)]
                break
            drafts.append(token)
            if len(drafts) == k or self.target.is_end(token):  # nothing after an end token is ever used
                break
            logits = self.draft.decode([token], len(self.draft.cached), all_logits=False)[-1]
        stats.draft_seconds += time.perf_counter() - start
        return drafts, draft_probs

    def _verify(
        self,
        rows: np.ndarray,
        drafts: list[int],
        draft_probs: list[np.ndarray],
        config: SamplingConfig,
        rng: np.random.Generator,
    ) -> tuple[int, int]:
        """(number of drafts accepted, the target's own next token)."""
        if config.temperature <= 0:
            accepted = 0
            while accepted < len(drafts) and int(rows[accepted].argmax()) == drafts[accepted]:
                accepted += 1
            return accepted, int(rows[accepted].argmax())
        for index, token in enumerate(drafts):
            p = probabilities(rows[index], config)
            q = draft_probs[index]
            if rng.random() < min(1.0, p[token] / q[token]):
                continue
            residual = np.maximum(p - q, 0.0)
            total = residual.sum()
            residual = residual / total if total > 0 else p
            return index, int(rng.choice(residual.size, p=residual))
        p = probabilities(rows[len(drafts)], config)
        return len(drafts), int(rng.choice(p.size, p=p))

    def generate(
        self, prompt: list[int], config: SamplingConfig, on_tokens: Callable[[list[int]], bool] | None = None
    ) -> tuple[list[int], Stats]:
        """Generate after `prompt`. `on_tokens` gets each step's new tokens; returning False stops early."""
        if not prompt:
            raise SpectuneError("empty prompt")
        if len(prompt) >= self.target.n_ctx:
            raise SpectuneError(f"prompt of {len(prompt)} tokens does not fit the context of {self.target.n_ctx}")
        stats = Stats(prompt_tokens=len(prompt))
        rng = np.random.default_rng(config.seed)
        begin = time.perf_counter()
        # A voice call is many short turns on a growing context: keep the KV of the shared prefix.
        reused = self.target.reusable_prefix(prompt[:-1])
        self.target.truncate(reused)
        if len(prompt) - 1 > reused:
            self.target.decode(prompt[reused:-1], reused, all_logits=False)
        stats.reused_prompt_tokens = reused
        stats.prefill_seconds = time.perf_counter() - begin
        sequence = list(prompt)  # every token so far; the last one is not yet in the target's cache
        output: list[int] = []
        k = config.draft_max
        stop_text = config.stop
        while len(output) < config.max_tokens:
            room = self.target.n_ctx - len(sequence)  # positions left for the last token and the proposals
            if room <= 0:
                stats.finish_reason = "length"
                break
            step_k = max(0, min(k, room - 1, config.max_tokens - len(output) - 1))
            drafts, draft_probs = self._propose(sequence, step_k, config, rng, stats)
            start = time.perf_counter()
            position = len(sequence) - 1
            rows = self.target.decode([sequence[-1], *drafts], position, all_logits=True)
            accepted, own = self._verify(rows, drafts, draft_probs, config, rng)
            self.target.truncate(position + 1 + accepted)  # keep the last token and the accepted drafts
            stats.verify_seconds += time.perf_counter() - start
            stats.verify_steps += 1
            stats.drafted += len(drafts)
            stats.accepted += accepted
            for index in range(len(drafts)):
                if index >= len(stats.drafted_at):
                    stats.drafted_at.append(0)
                    stats.accepted_at.append(0)
                stats.drafted_at[index] += 1
                stats.accepted_at[index] += int(index < accepted)
            if config.adaptive and drafts:
                k = min(config.draft_max, k + 1) if accepted == len(drafts) else max(1, min(k, accepted + 1))
            new = [*drafts[:accepted], own]
            ended = next((i for i, token in enumerate(new) if self.target.is_end(token)), None)
            stats.produced += len(new) if ended is None else ended + 1  # up to the end token, which τ counts
            if ended is not None:
                new = new[:ended]
                stats.finish_reason = "stop"
            new = new[: config.max_tokens - len(output)]
            before = len(output)
            output += new
            sequence += new
            if stop_text:
                text = self.target.detokenize(output)
                hit = min((text.find(s) for s in stop_text if s in text), default=-1)
                if hit >= 0:
                    output = _cut_at_text(self.target, output, hit)
                    stats.finish_reason = "stop"
            new = output[before:]
            if before == 0 and new:
                stats.ttft_seconds = time.perf_counter() - begin
            keep_going = on_tokens(new) if (on_tokens and new) else True
            if stats.finish_reason == "stop" or keep_going is False:
                if keep_going is False:
                    stats.finish_reason = "cancelled"
                break
        stats.generated = len(output)
        stats.total_seconds = time.perf_counter() - begin
        return output, stats


def _cut_at_text(model: LlamaModel, tokens: list[int], char_index: int) -> list[int]:
    """The longest prefix of `tokens` whose text ends at or before `char_index`."""
    kept: list[int] = []
    for token in tokens:
        if len(model.detokenize([*kept, token])) > char_index:
            break
        kept.append(token)
    return kept
