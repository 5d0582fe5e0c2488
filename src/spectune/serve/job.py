"""One generation on a worker thread, its text handed to the event loop piece by piece, and the usage and
statistics an answer reports."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from typing import Any

from spectune.runtime.decode import DecodeSettings
from spectune.runtime.first_words import FirstWords
from spectune.runtime.speculative import Generation
from spectune.runtime.stats import Stats
from spectune.serve.config import ServeConfig
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


def stats_json(stats: Stats) -> dict[str, Any]:
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
    return {key: values[key] for key in keys}


# Text reaches the event loop at most this long after it is final: each hand-over (a wake of the loop, a chunk, a
# write) cost about 50 us on the demo pair, whose tokens come every 0.35 ms; a model that slow shares chunks, one of
# 25 ms a token (the Qwen 1.5B here) still streams every token as it comes.
HAND_OVER_SECONDS = 0.002


class Job:
    """One generation on a worker thread; its text comes back through an asyncio queue."""

    def __init__(
        self,
        slot: Slot,
        prompt: list[int],
        sampling: DecodeSettings,
        loop: asyncio.AbstractEventLoop,
        config: ServeConfig,
        arrived: float,
    ) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.slot, self.prompt, self.sampling, self.loop = slot, prompt, sampling, loop
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
            result = self.slot.decoder.generate(self.prompt, self.sampling, on_text, self.first_words)
        except Exception as exc:  # surfaces in the request that waits for it
            self._call(self._finish, None, exc)
        else:
            if unsent[0]:
                hand_over()
            self._call(self._finish, result, None)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(result)
        self.queue.put_nowait(None)

    async def result(self) -> Generation:
        return await asyncio.shield(self.done)
