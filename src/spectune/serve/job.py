"""One generation on a worker thread, its text handed to the event loop piece by piece, and the usage and
statistics an answer reports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from spectune.runtime.chat import turn_opening
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.first_words import FirstWords
from spectune.runtime.kv_state import save_decoder
from spectune.runtime.speculative import Checkpoint, Generation
from spectune.runtime.stats import Stats
from spectune.serve.config import ServeConfig
from spectune.serve.prefix_cache import Caller, PrefixStore, conversation_key, shared_key
from spectune.serve.slots import Slot

logger = logging.getLogger(__name__)


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


@dataclass
class Prefix:
    """What a job's prefill may reuse and what it leaves for later (serve/prefix_cache.py)."""

    caller: Caller
    shared: int  # where the caller's first words start in the prompt (what the caller's scope shares)
    store: PrefixStore
    reuse: bool  # the server's reuse_prefix
    messages: list[dict[str, str]]  # the conversation rendered: what opens the caller's next turn follows from it


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
        self.wanted = threading.Event()  # a caller waits for a slot: work nobody waits for stops (yield_slot)
        self._yieldable = False  # the job thread is in such work: yield_slot cuts its decode
        self._yield_lock = threading.Lock()
        self.done: asyncio.Future = loop.create_future()  # the answer (or the prefill) is complete
        self.freed: asyncio.Future = loop.create_future()  # the slot is free again: the work after the answer is done
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
            result = self._prefill_only() if self.prefill_only else self._generate(on_text)
        except Exception as exc:  # surfaces in the request that waits for it
            self._call(self._finish, None, exc)
        else:
            if unsent[0]:
                hand_over()
            self._call(self._finish, result, None)
            self._after(result)
        self._call(self.freed.set_result, None)

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

    def yield_slot(self) -> None:
        """From the event loop: a caller needs the slot. Work nobody waits for (a prefill-only request, the opening
        of a caller's next turn after an answer) stops at once, its decode cut within a graph node."""
        with self._yield_lock:
            self.wanted.set()
            if self._yieldable:
                self.slot.decoder.interrupt(True)

    @contextlib.contextmanager
    def _yielding(self) -> Iterator[Callable[[], bool]]:
        """Work nobody waits for, on the job thread: a function that says whether to go on (yield_slot)."""
        with self._yield_lock:
            self._yieldable = True
            self.slot.decoder.interrupt(self.wanted.is_set())
        try:
            yield lambda: not self.wanted.is_set()
        finally:
            with self._yield_lock:  # before the slot is free: the next job decodes uncut
                self._yieldable = False
                self.slot.decoder.interrupt(False)

    def _prefill_only(self) -> Generation:
        stats = Stats()
        with self._yielding() as unwanted:

            def keep_going() -> bool:  # nor has its caller hung up
                return unwanted() and not self.cancel.is_set()

            decoded = self.slot.decoder.prefill(self.prompt, stats, keep_going, self._checkpoint())
        stats.finish_reason = "length" if decoded is not None else "cancelled"
        return Generation([], "", stats)

    def _after(self, result: Generation) -> None:
        """While the caller listens (the answer is sent, the slot still held): decode what opens the caller's next
        turn, then keep the conversation as the caches hold it, for that turn in whichever slot serves it. A failure
        here costs the next turn its reuse, nothing else: logged, not raised."""
        prefix = self.prefix
        if not prefix.reuse or prefix.caller.user is None or self.aborted:
            return
        try:
            if result.stats.finish_reason != "cancelled" and not self.prefill_only:
                self._open_next_turn(result.text)
            if prefix.store.max_bytes and not self.aborted:
                prefix.store.put(conversation_key(prefix.caller), save_decoder(self.slot.decoder))
        except Exception:
            logger.exception("keeping the conversation of %s for its next turn", prefix.caller)

    def _open_next_turn(self, answer: str) -> None:
        """The caller's next prompt starts with this one, the answer and the template's text before the caller's
        words: decoded now (yielding to a waiting caller), that turn prefills only its words."""
        model = self.slot.target
        opening = turn_opening(model, self.prefix.messages)
        if opening:
            tokens = self.prompt + model.tokenize(answer, special=False) + opening
            with self._yielding() as keep_going:
                self.slot.decoder.extend(tokens, keep_going)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(result)
        self.queue.put_nowait(None)

    async def result(self) -> Generation:
        return await asyncio.shield(self.done)
