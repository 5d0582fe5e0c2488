"""One generation on a worker thread, its text handed to the event loop piece by piece, and the usage and
statistics an answer reports."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spectune.runtime.decode import DecodeSettings
from spectune.runtime.first_words import FirstWords
from spectune.runtime.kv_state import save_decoder
from spectune.runtime.speculative import Checkpoint, Generation
from spectune.runtime.stats import Stats
from spectune.serve.config import ServeConfig
from spectune.serve.prefix_cache import Caller, PrefixStore, conversation_key, shared_key
from spectune.serve.slots import Slot


def cut_message(stats: Stats) -> str:
    return f"the server shut down while answering: the answer was cut after {stats.generated} tokens"


def usage(stats: Stats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt_tokens + stats.generated,
        # OpenAI's field for the prompt prefix served from cache: a conversation's earlier turns.
        "prompt_tokens_details": {"cached_tokens": stats.reused_prompt_tokens},
    }


def stats_json(stats: Stats, stages: dict[str, float]) -> dict[str, Any]:
    keys = (
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_len",
        "ttft_seconds",
        "tokens_per_second",
        "reused_prompt_tokens",
        "draft_reused_prompt_tokens",
        "draft_seconds",
        "verify_seconds",
        "by_source",  # per speculator that proposed: steps, drafted, accepted
    )
    values = stats.as_dict()
    first_step = max(0.0, stats.ttft_seconds - stats.prefill_seconds) if stats.generated else 0.0
    timings = {**stages, "prefill_seconds": stats.prefill_seconds, "first_step_seconds": first_step}
    return {key: values[key] for key in keys} | {"stages": timings}


# Text reaches the event loop at most this long after it is final: each hand-over (a wake of the loop, a chunk, a
# write) cost about 50 us on the demo pair, whose tokens come every 0.35 ms; a model that slow shares chunks, one of
# 25 ms a token (the Qwen 1.5B here) still streams every token as it comes.
HAND_OVER_SECONDS = 0.002


PREFILL_ONLY_BATCH = 32  # a prefill-only request yields its slot to a waiting caller within this many tokens


@dataclass
class Prefix:
    """What a job's prefill may reuse and what it leaves for later (serve/prefix_cache.py)."""

    caller: Caller
    shared: int  # where the caller's first words start in the prompt (what the caller's scope shares)
    store: PrefixStore
    reuse: bool  # the server's reuse_prefix


class Job:
    """One generation on a worker thread (or, for a request of max_tokens 0, only the prefill of its prompt); its
    text comes back through an asyncio queue."""

    def __init__(
        self,
        slot: Slot,
        prompt: list[int],
        sampling: DecodeSettings | None,
        loop: asyncio.AbstractEventLoop,
        config: ServeConfig,
        arrived: float,
        prefix: Prefix,
    ) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.slot, self.prompt, self.sampling, self.loop = slot, prompt, sampling, loop
        self.prefix = prefix
        self.prefill_only = sampling is None  # extend the caller's cached prefix, answer nothing
        self.stages: dict[str, float] = {}  # seconds per stage before the first token (the server adds its own)
        self.first_words: FirstWords = config.first_words
        self.deadline = time.monotonic() + config.max_seconds
        self.arrived = arrived  # when the request came (perf_counter): the caller's time to first token runs from it
        self.started = time.perf_counter()  # the generation's start, set again when its thread begins
        self.timed_out = False
        self.aborted = False  # cut by the server's shutdown, not by the caller or a limit
        # each piece of text with the usage counted when it was made (the slot's live counts move on to the next
        # request while a slow reader still reads this one's)
        self.queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
        self.cancel = threading.Event()
        self.done: asyncio.Future = loop.create_future()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def cut_by_shutdown(self) -> bool:
        """The server's shutdown stopped this generation before it ended by itself (not one that had just ended)."""
        return self.aborted and self.done.result().stats.finish_reason == "cancelled"

    def finish_reason(self) -> str:
        """OpenAI's reasons, and vLLM's `abort` for an answer the server's shutdown cut."""
        if self.cut_by_shutdown:
            return "abort"
        reason = self.done.result().stats.finish_reason
        return "length" if reason == "length" or self.timed_out else "stop"

    def _call(self, *args: Any) -> None:
        """Hand something to the event loop, unless it has closed (the server is shutting down)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(*args)

    def _run(self) -> None:
        unsent, handed_at = [""], [0.0]  # text not yet handed to the event loop, and when text last was

        def hand_over() -> None:
            self._call(self.queue.put_nowait, (unsent[0], usage(self.slot.decoder.progress)))
            unsent[0], handed_at[0] = "", time.perf_counter()

        def on_text(text: str) -> bool:
            unsent[0] += text
            if unsent[0] and time.perf_counter() - handed_at[0] >= HAND_OVER_SECONDS:
                hand_over()
            if time.monotonic() > self.deadline:
                self.timed_out = True
            return not (self.cancel.is_set() or self.timed_out)

        self.started = time.perf_counter()
        try:
            self._prepare()
            result = self._prefill_only() if self.sampling is None else self._generate(on_text)
            self._keep(result)
        except Exception as exc:  # surfaces in the request that waits for it
            self._call(self._finish, None, exc)
        else:
            if unsent[0]:
                hand_over()
            self._call(self._finish, result, None)

    def _prepare(self) -> None:
        start = time.perf_counter()
        prefix = self.prefix
        self.slot.prepare(prefix.caller, self.prompt, prefix.shared, prefix.store, prefix.reuse)
        self.stages["restore_seconds"] = time.perf_counter() - start

    def _checkpoint(self) -> Checkpoint:
        """Save the scope's shared prefix where the prefill passes it, unless it is stored already."""
        prefix, decoder = self.prefix, self.slot.decoder
        key = shared_key(prefix.caller.scope, self.prompt[: prefix.shared])
        if not prefix.reuse or not prefix.shared or not prefix.store.max_bytes or prefix.store.get(key) is not None:
            return None
        return prefix.shared, lambda: prefix.store.put(key, save_decoder(decoder))

    def _generate(self, on_text: Callable[[str], bool]) -> Generation:
        assert self.sampling is not None
        decoder = self.slot.decoder
        return decoder.generate(self.prompt, self.sampling, on_text, self.first_words, self._checkpoint())

    def _prefill_only(self) -> Generation:
        stats = Stats()
        decoded = self.slot.decoder.prefill(
            self.prompt, stats, lambda: not self.cancel.is_set(), self._checkpoint(), PREFILL_ONLY_BATCH
        )
        stats.finish_reason = "length" if decoded is not None else "cancelled"
        return Generation([], "", stats)

    def _keep(self, result: Generation) -> None:
        """The caller's conversation as the caches hold it now, for its next turn in whichever slot serves it."""
        prefix = self.prefix
        if prefix.reuse and prefix.store.max_bytes and prefix.caller.user is not None and not self.aborted:
            start = time.perf_counter()
            prefix.store.put(conversation_key(prefix.caller), save_decoder(self.slot.decoder))
            self.stages["save_seconds"] = time.perf_counter() - start

    def _finish(self, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(result)
        self.queue.put_nowait(None)

    async def result(self) -> Generation:
        return await asyncio.shield(self.done)
