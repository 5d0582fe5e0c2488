"""An OpenAI-compatible streaming server for voice bots: target + draft with speculative decoding.

POST /v1/chat/completions (stream or not), GET /v1/models, GET /health, GET /metrics (Prometheus).
N slots, each its own llama.cpp contexts; requests wait fairly (FIFO) for a slot and get 503 with Retry-After
past a bound; a client that disconnects stops its generation and frees its slot. A slot keeps its KV cache,
so the next turn of a conversation reuses the shared prompt prefix. `"chunking": "sentence"` streams whole
clauses for a TTS engine instead of token deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from spectune.errors import SpectuneError
from spectune.runtime.build import identity_verdict
from spectune.runtime.chat import CLAUSE_END, prompt_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.mode import answer_class, choose
from spectune.runtime.stats import Stats
from spectune.serve.config import ServeConfig
from spectune.serve.connections import CUT_BY_SERVER
from spectune.serve.guard import Guard, TooLarge, read_body
from spectune.serve.job import Job, Prefix, cut_message, stats_json, usage
from spectune.serve.metrics import make_metrics, mode_metrics, prefix_metrics
from spectune.serve.prefix_cache import Caller, PrefixStore, Scope
from spectune.serve.refusal import error_body, key_tenant
from spectune.serve.schema import ChatRequest, lone_surrogate, unsupported_parameter
from spectune.serve.slots import Slot, calibration_conversations, check_slot_memory, decoder_source


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    shared: int  # where the caller's first words start: what its scope shares (serve/prefix_cache.py)
    messages: list[dict[str, str]]  # as the template rendered them
    seconds: float  # rendering and tokenizing it took


HANG_UP_CHECK_SECONDS = 0.05  # how often a stream asks whether its caller hung up (each ask costs the event loop)


class Server:
    """The slots, the metrics, the running generations and the request handling; `create_app` maps the routes."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.decoding = config.decoding()
        self.registry = CollectorRegistry()
        self.metrics = make_metrics(self.registry)
        self.slots: asyncio.Queue[Slot] = asyncio.Queue()
        source = decoder_source(config)
        conversations = calibration_conversations(config.calibration_data)
        self.choice, first = choose(config.mode, source, conversations, self.decoding, recalibrate=config.recalibrate)
        check_slot_memory(first, config.slots, self.choice.mode)
        self.device = first.target.device  # where the models run: the CPU, or so many layers on the GPU
        self.slots.put_nowait(Slot(first))
        for _ in range(config.slots - 1):
            self.slots.put_nowait(Slot(source.load(self.choice.mode)))
        mode_metrics(self.registry, self.choice)
        self.tokenizer = first.target  # tokenizing reads only the vocabulary: any slot's target does it, slot or not
        self.store = PrefixStore(config.prefix_cache_mib << 20)
        prefix_metrics(self.metrics, self.store)
        self.pending: dict[Caller, Job] = {}  # each caller's running prefill-only request: the next one cancels it
        self.jobs: set[Job] = set()
        self.queued = 0  # requests waiting for a slot (with the jobs: the requests in progress)
        self.metrics["queue"].set_function(lambda: self.queued)  # the gauge reads the count, never a copy of it
        self.closing = False
        self.closed = asyncio.Event()  # wakes the requests waiting for a slot when the server stops
        self.loop: asyncio.AbstractEventLoop | None = None
        self.busy_since: float | None = None  # when the last free slot was taken
        self.connection_limits: dict[str, int] = {}  # the connection cap and the open-file limit it fits (launch)
        # OpenAI's field for "which backend configuration produced this answer": the build and the setting.
        # Which "target alone" the answers equal: the same class whatever start-up timing picked the mode (mode.py).
        exact = config.exact and self.choice.mode == "speculative"
        verdict = identity_verdict(config.target, exact)
        answers = answer_class(self.choice.mode, verdict["guaranteed"])
        self.fingerprint = f"{verdict['build']}; exact {'on' if exact else 'off'}; {answers}"

    def close(self) -> None:
        """The first stop signal: cancel every generation and refuse every queued and new request (503), from any
        thread (not from a signal handler: see SpectuneUvicorn); the generations end at their next step, a decode in
        progress cut within a graph node (LlamaModel.abort)."""
        self.closing = True
        for job in list(self.jobs):
            job.aborted = True
            job.cancel.set()
            job.slot.decoder.abort()  # a long prefill batch is cut within a graph node, not waited for
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.closed.set)

    def shutdown(self) -> None:
        """Stop every generation and wait for its thread: no thread may be inside llama.cpp when models are freed."""
        self.close()
        for job in list(self.jobs):
            job.thread.join(timeout=60)

    def health(self) -> tuple[int, dict[str, Any]]:
        """Degraded (503) when no slot has been free for longer than a queued request may wait, or when stopping."""
        busy = self.busy_since is not None and time.monotonic() - self.busy_since > self.config.queue_timeout
        status = "stopping" if self.closing else "degraded" if busy else "ok"
        body = {
            "status": status,
            "slots_free": self.slots.qsize(),
            "slots": self.config.slots,
            "mode": self.choice.mode,
            "mode_reason": self.choice.reason,
            "device": self.device,
            **self.connection_limits,
        }
        return (200 if status == "ok" else 503), body

    def fail(self, status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None) -> Any:
        self.metrics["requests"].labels(status=str(status)).inc()
        code, body = error_body(status, message, kind, param)
        return JSONResponse(body, status_code=code, headers=headers)

    async def parse(self, request: Request) -> ChatRequest | JSONResponse:
        """The request, or the error response that says what is wrong with it."""
        limit = self.config.max_request_bytes
        try:
            body = json.loads(await read_body(request, limit))
        except ClientDisconnect:  # hung up mid-upload, or cut by the connection, which answered it (408, 503)
            if (cut := request.scope.get(CUT_BY_SERVER)) is not None:
                return self.fail(*cut)
            return self.fail(499, "the client went away during the upload", "client_closed")
        except TooLarge:
            return self.fail(413, f"request larger than {limit} bytes", "invalid_request_error")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return self.fail(400, f"malformed JSON: {exc}", "invalid_request_error")
        except RecursionError:
            return self.fail(400, "malformed JSON: nested too deeply", "invalid_request_error")
        if isinstance(body, dict) and isinstance(body.get("extra_body"), dict):
            body = {**body, **body["extra_body"]}
        if (where := lone_surrogate(body)) is not None:
            message = f"{where}: not valid Unicode (half of a UTF-16 surrogate pair, e.g. a cut emoji)"
            return self.fail(400, message, "invalid_request_error", where)
        if isinstance(body, dict) and (name := unsupported_parameter(body)) is not None:
            message = f"{name}: not supported by this server (leave it out or at its default)"
            return self.fail(400, message, "unsupported_parameter", name)
        try:
            chat = ChatRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(part) for part in first["loc"])
            status = 422 if first["type"] != "missing" else 400
            return self.fail(status, f"{param}: {first['msg']}", "invalid_request_error", param)
        if chat.model not in (None, "", self.config.model_name):
            message = f"model {chat.model!r} is not served here (this server serves {self.config.model_name!r})"
            return self.fail(404, message, "model_not_found", "model")
        return chat

    async def take_slot(self, request: Request) -> Slot | JSONResponse:
        """A free slot, waited for in arrival order; 503 past the queue timeout or when the server stops. A caller
        who has to wait waits for no work nobody waits for (a prefill-only request, the decoding of a caller's next
        turn's opening after an answer): that yields its slot at once, its decode cut within a graph node."""
        if self.closing:
            return self.fail(503, "the server is shutting down", "server_shutting_down")
        if self.slots.empty():
            for job in self.jobs:
                job.yield_slot()
        if self.queued + len(self.jobs) >= self.config.limit_concurrency:
            message = f"{self.config.limit_concurrency} requests are in progress; retry shortly"
            return self.fail(503, message, "server_busy", headers={"Retry-After": "1"})
        self.queued += 1
        getter = asyncio.ensure_future(self.slots.get())
        stopping = asyncio.ensure_future(self.closed.wait())
        try:
            await asyncio.wait({getter, stopping}, timeout=self.config.queue_timeout, return_when="FIRST_COMPLETED")
        finally:
            self.queued -= 1
            stopping.cancel()
            getter.cancel()  # a no-op when it already has its slot
        slot = getter.result() if getter.done() and not getter.cancelled() else None
        if slot is None or self.closing:
            if slot is not None:
                self.slots.put_nowait(slot)
            if self.closing:
                return self.fail(503, "the server is shutting down", "server_shutting_down")
            if await request.is_disconnected():  # gave up waiting before the server did
                return self.fail(499, "the client went away while waiting", "client_closed")
            retry = str(max(1, int(self.config.queue_timeout)))
            return self.fail(503, "all slots are busy; retry shortly", "server_busy", headers={"Retry-After": retry})
        self.metrics["slots_in_use"].inc()
        if self.slots.empty():
            self.busy_since = time.monotonic()
        if await request.is_disconnected():  # abandoned while it waited: never run it
            self.release(slot)
            return self.fail(499, "the client went away while waiting", "client_closed")
        return slot

    def release(self, slot: Slot) -> None:
        self.metrics["slots_in_use"].dec()
        self.busy_since = None
        self.slots.put_nowait(slot)

    def sampling(self, chat: ChatRequest, room: int) -> DecodeSettings:
        """The server's decoding settings with what the request names on top, its answer cut to the room left."""
        wanted = chat.decode_settings()
        length = min(wanted.get("max_tokens", self.config.max_tokens), room - 1)
        return DecodeSettings.model_validate(self.decoding.model_dump() | wanted | {"max_tokens": length})

    async def tokenized(self, chat: ChatRequest) -> Prompt | JSONResponse:
        """The conversation's tokens and where its shared system messages end, before any slot is taken (off the
        event loop: a long conversation must not hold up every other caller), or why not."""
        start = time.perf_counter()
        messages = [m.for_template() for m in chat.messages]
        try:
            tokens, shared = await asyncio.to_thread(prompt_tokens, self.tokenizer, messages)
        except SpectuneError as exc:
            return self.fail(400, str(exc), "invalid_request_error", "messages")
        if self.tokenizer.n_ctx - len(tokens) <= 1:
            message = f"the conversation is {len(tokens)} tokens; the context holds {self.tokenizer.n_ctx}"
            return self.fail(413, message, "context_length_exceeded", "messages")
        return Prompt(tokens, shared, messages, time.perf_counter() - start)

    def start(self, slot: Slot, chat: ChatRequest, prompt: Prompt, caller: Caller, arrived: float) -> Job:
        """Start the generation (or the prefill of a max_tokens 0 request) in the slot; the slot goes back when it
        ends, or at once where it cannot start."""
        try:
            room = slot.target.n_ctx - len(prompt.tokens)
            sampling = None if chat.prefill_only else self.sampling(chat, room)
            prefix = Prefix(caller, prompt.shared, self.store, self.config.reuse_prefix, prompt.messages)
            job = Job(slot, prompt.tokens, sampling, asyncio.get_running_loop(), self.config, arrived, prefix)
        except BaseException:  # anything, cancellation included: the Guard answers 500 and counts it
            self.release(slot)
            raise
        job.stages["tokenize_seconds"] = prompt.seconds
        job.stages["queue_seconds"] = time.perf_counter() - arrived - prompt.seconds  # parsing it included
        self.jobs.add(job)
        if chat.prefill_only:
            self.pending[caller] = job

        def ended(_: Any) -> None:  # the slot is free exactly when its job has ended, the work after the answer too
            self.jobs.discard(job)
            if self.pending.get(caller) is job:
                del self.pending[caller]
            self.release(slot)

        job.freed.add_done_callback(ended)
        job.start()
        if self.closing:  # stopped while this request was being tokenized
            job.cancel.set()
        return job

    def caller(self, request: Request, chat: ChatRequest) -> Caller:
        """Who sends this request, as far as sharing cached prompts goes (serve/prefix_cache.py)."""
        keys = self.config.api_key
        tenant = key_tenant(request.headers.get("authorization"), keys) if keys else None
        return Caller(Scope(tenant or "", chat.cache_salt or ""), chat.user)

    async def completions(self, request: Request) -> Any:
        arrived = time.perf_counter()
        chat = await self.parse(request)
        if isinstance(chat, JSONResponse):
            return chat
        caller = self.caller(request, chat)
        if (running := self.pending.get(caller)) is not None:  # a newer turn of this caller's words
            running.yield_slot()
        prompt = await self.tokenized(chat)
        if isinstance(prompt, JSONResponse):
            return prompt
        if chat.prefill_only and self.slots.empty():  # never waits: it would take a caller's slot time
            return self.nothing_prefilled(prompt)
        slot = await self.take_slot(request)
        if isinstance(slot, JSONResponse):
            return slot
        self.metrics["queue_wait"].observe(time.perf_counter() - arrived)
        job = self.start(slot, chat, prompt, caller, arrived)
        if chat.stream:
            return StreamingResponse(self.stream(job, chat, request), media_type="text/event-stream")
        hung_up = False
        while not job.done.done():  # a caller who hangs up stops the generation and frees the slot
            await asyncio.wait([job.done], timeout=0.1)
            if not job.done.done() and await request.is_disconnected():
                hung_up = True
                job.cancel.set()
        if job.done.exception() is not None:
            return self.fail(500, f"generation failed: {job.done.exception()}", "server_error")
        if hung_up:
            return self.fail(499, "the client went away", "client_closed")
        generation = job.done.result()
        if job.cut_by_shutdown:  # an answer cut short must not read as whole
            return self.fail(503, cut_message(generation.stats), "server_shutting_down")
        self.record(job, generation.stats)
        return {
            "id": job.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.model_name,
            "system_fingerprint": self.fingerprint,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": generation.text},
                    "finish_reason": job.finish_reason(),
                }
            ],
            "usage": usage(generation.stats),
            "spectune": stats_json(generation.stats, job.stages),
        }

    async def stream(self, job: Job, chat: ChatRequest, request: Request) -> AsyncIterator[bytes]:
        pending = ""
        finished = False
        continuous = chat.stream_options is not None and chat.stream_options.continuous_usage_stats
        counted: dict[str, Any] | None = None  # the usage as of the last text read
        yield sse(self.chunk(job, {"role": "assistant", "content": ""}, None))
        checked = time.monotonic()  # when the connection was last asked whether the caller is still there
        try:
            ended = False
            while not ended and (item := await job.queue.get()) is not None:
                text, counted = item
                pending += text
                # What is already queued (the generation ran ahead of this stream) goes out together: each chunk is
                # a write here and a read by the caller (see job.HAND_OVER_SECONDS for what that cost).
                while not job.queue.empty():
                    if (item := job.queue.get_nowait()) is None:
                        ended = True
                        break
                    pending, counted = pending + item[0], item[1]
                if time.monotonic() - checked > HANG_UP_CHECK_SECONDS:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        job.cancel.set()
                pieces, pending = clauses(pending) if chat.chunking == "sentence" else ([pending], "")
                for piece in filter(None, pieces):
                    yield sse(self.chunk(job, {"content": piece}, None, counted if continuous else None))
            try:
                generation = await job.result()
            except Exception as exc:  # the stream says so and ends properly, and /metrics counts it
                finished = True
                self.metrics["requests"].labels(status="500").inc()
                yield sse(error_body(500, f"generation failed: {exc}", "server_error")[1])
                yield b"data: [DONE]\n\n"
                return
            whole = usage(generation.stats)
            if pending:
                yield sse(self.chunk(job, {"content": pending}, None, counted if continuous else None))
            final = self.chunk(job, {}, job.finish_reason(), whole if continuous else None)
            final["spectune"] = stats_json(generation.stats, job.stages)
            yield sse(final)
            if job.cut_by_shutdown:  # the stream says the answer was cut, and /metrics counts it so
                finished = True
                self.metrics["requests"].labels(status="503").inc()
                yield sse(error_body(503, cut_message(generation.stats), "server_shutting_down")[1])
                yield b"data: [DONE]\n\n"
                return
            if chat.stream_options and chat.stream_options.include_usage:  # OpenAI: a last chunk with no choices
                yield sse({**self.chunk(job, {}, None), "choices": [], "usage": usage(generation.stats)})
            yield b"data: [DONE]\n\n"
            finished = True
            self.record(job, generation.stats)
        finally:
            job.cancel.set()  # a client gone mid-stream stops the generation, which frees the slot
            if not finished:
                self.metrics["requests"].labels(status="499").inc()

    def nothing_prefilled(self, prompt: Prompt) -> dict[str, Any]:
        """A prefill-only request that found no free slot: 200, nothing done (the final request prefills)."""
        self.metrics["requests"].labels(status="200").inc()
        counts = usage(Stats(prompt_tokens=len(prompt.tokens)))
        return {"object": "chat.completion", "model": self.config.model_name, "choices": [], "usage": counts}

    def record(self, job: Job, stats: Stats) -> None:
        self.metrics["requests"].labels(status="200").inc()
        self.metrics["cached_tokens"].inc(stats.reused_prompt_tokens)
        for stage, seconds in stats_json(stats, job.stages)["stages"].items():
            self.metrics["stages"].labels(stage=stage.removesuffix("_seconds")).observe(seconds)
        if stats.generated:
            self.metrics["ttft"].observe(job.started + stats.ttft_seconds - job.arrived)
        self.metrics["tps"].observe(stats.tokens_per_second)
        self.metrics["acceptance"].set(stats.acceptance_rate)
        self.metrics["accepted_len"].set(stats.mean_accepted_len)

    def chunk(self, job: Job, delta: dict, reason: str | None, counts: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {
            "id": job.id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.config.model_name,
            "system_fingerprint": self.fingerprint,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        }
        if counts is not None:  # vLLM's continuous_usage_stats: this answer's counts so far in every chunk
            body["usage"] = counts
        return body


def create_app(config: ServeConfig) -> FastAPI:
    server = Server(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.loop = asyncio.get_running_loop()
        yield
        await asyncio.to_thread(server.shutdown)

    app = FastAPI(title="spectune", version="1", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Guard, server=server)

    @app.get("/health")
    async def health() -> Any:
        status, body = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "owned_by": "spectune"}]}

    @app.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(generate_latest(server.registry).decode(), media_type="text/plain; version=0.0.4")

    app.post("/v1/chat/completions")(server.completions)
    return app


def clauses(text: str) -> tuple[list[str], str]:
    """Each whole clause in `text`, one a chunk as a TTS engine speaks them, and the unfinished rest."""
    ends = [match.end() for match in CLAUSE_END.finditer(text)]
    return [text[start:end] for start, end in zip([0, *ends], ends, strict=False)], text[ends[-1] :] if ends else text


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
