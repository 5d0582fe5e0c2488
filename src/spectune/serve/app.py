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
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import Field, ValidationError, model_validator
from starlette.requests import ClientDisconnect

from spectune.data.read import assistant_turns
from spectune.engines.llama_server import free_port
from spectune.errors import SpectuneError
from spectune.layout import RunLayout
from spectune.runtime.build import identity_verdict
from spectune.runtime.chat import CLAUSE_END, chat_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel, is_eagle3_gguf
from spectune.runtime.ngram import NgramDrafter, NgramSettings, NgramTable, domain_of_texts
from spectune.runtime.speculative import FirstWords, Generation, SpeculativeDecoder, Stats
from spectune.serve.connections import BODY_TIMED_OUT, guarded_protocol
from spectune.serve.guard import Guard
from spectune.serve.schema import ChatRequest, lone_surrogate, unsupported_parameter

# What llama-server has no equivalent for (its request size, queue, time and connection limits are its own).
SPECTUNE_ONLY = {
    "queue_timeout",
    "max_request_bytes",
    "max_seconds",
    "reuse_prefix",
    "limit_concurrency",
    "max_connections",
    "header_timeout",
    "body_timeout",
    "keep_alive",
    "first_words",
    "ngram_data",  # llama-server's n-gram speculator reads the conversation only
    "stop",  # a request's own stop strings reach llama-server; it has no server-wide default
    "min_tokens",
    "adaptive",
}


class ServeConfig(DecodeSettings):
    """Everything `spectune serve` takes; the decoding settings are the defaults of a request that names none
    (as llama-server's -n, --temp, --top-k, ...)."""

    engine: Literal["spectune", "llama.cpp"] = Field(
        "spectune", description="spectune's own server, or llama.cpp's llama-server on the same pair and settings."
    )
    llama_server: Path | None = Field(
        None, description="The llama-server binary for --engine llama.cpp (default: `spectune tools build-llama-cpp`)."
    )
    target: Path | None = Field(None, description="Target GGUF (or --run).")
    draft: Path | None = Field(None, description="Draft GGUF: speculative decoding (or --run).")
    run: Path | None = Field(None, description="A finished `spectune run` folder: serve its chosen pair and k.")
    host: str = Field("127.0.0.1", description="Bind address (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="Port.")
    slots: int = Field(1, ge=1, description="Concurrent generations (each its own contexts).")
    n_ctx: int = Field(4096, ge=64, description="Context length per slot.")
    queue_timeout: float = Field(30.0, gt=0, description="Seconds a request may wait for a slot, then 503.")
    api_key: str | None = Field(None, min_length=1, description="Require this bearer token (also $SPECTUNE_API_KEY).")
    threads: int | None = Field(None, ge=1, description="Threads for llama.cpp (default: $SPECTUNE_THREADS or all).")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest request body (413 past it).")
    max_seconds: float = Field(120.0, gt=0, description="Longest a generation may run (then finish_reason length).")
    model_name: str = Field("spectune", description="The model id the API reports.")
    reuse_prefix: bool = Field(True, description="Keep a slot's KV cache for the next turn of a conversation.")
    first_words: FirstWords = Field(
        "auto",
        description="The first clause: drafted from the second token on (draft), by the target alone while the draft "
        "catches up (alone), or whichever this server has measured to come sooner (auto). The first token is "
        "always the target's own.",
    )
    limit_concurrency: int = Field(
        64, ge=1, description="Requests waiting for or holding a slot at most; 503 past it (/health never waits)."
    )
    max_connections: int = Field(
        1024, ge=2, description="Open connections at most; past it a new one closes the oldest that holds no request."
    )
    header_timeout: float = Field(
        10.0, gt=0, description="Seconds a connection may take to send a request's headers (half-open, slowloris)."
    )
    body_timeout: float = Field(10.0, gt=0, description="Seconds a request's body may take after its headers (408).")
    keep_alive: float = Field(5.0, gt=0, description="Seconds an idle keep-alive connection stays open.")
    ngram: NgramSettings | None = Field(
        None, description="N-gram lookup in front of the draft (or alone): the conversation's, and the domain's."
    )
    ngram_data: Path | None = Field(
        None, description="Chat dataset whose assistant turns fill the n-gram domain table (the target's answers)."
    )

    @model_validator(mode="after")
    def _pair(self) -> ServeConfig:
        own = sorted(SPECTUNE_ONLY & self.model_fields_set)
        if self.engine == "llama.cpp" and own:
            raise ValueError(f"{', '.join(own)}: settings of spectune's own server, not of --engine llama.cpp")
        if self.run is not None:  # the run's chosen pair, where the flags do not say otherwise
            chosen = RunLayout(self.run).read_chosen_pair()
            self.target = self.target or Path(chosen["target"])
            self.draft = self.draft or Path(chosen["draft"])
            self.draft_max = chosen["k"] if self.draft_max == "auto" else self.draft_max
            if "ngram" not in self.model_fields_set and chosen.get("ngram") is not None:
                self.ngram = NgramSettings.model_validate(chosen["ngram"])
                # llama-server's n-gram speculator reads the conversation only
                use_data = self.engine == "spectune" and not self.ngram_data and chosen.get("ngram_data")
                self.ngram_data = Path(chosen["ngram_data"]) if use_data else self.ngram_data
        if self.target is None:
            raise ValueError("give --target (and --draft), or --run RUN_DIR")
        if self.ngram_data is not None and self.ngram is None:
            raise ValueError("--ngram-data fills n-gram lookup's domain table: give --ngram too (e.g. --ngram on)")
        if self.engine == "spectune" and self.draft is not None and self.draft.is_file() and is_eagle3_gguf(self.draft):
            raise ValueError(
                f"{self.draft} is an EAGLE-3 head: serve it with --engine llama.cpp (spectune's own loop cannot hand "
                "it the target's layer inputs)"
            )
        self.draft_max = self.k
        return self


class Slot:
    def __init__(self, config: ServeConfig, domain: NgramTable | None) -> None:
        self.target = LlamaModel(config.target, n_ctx=config.n_ctx, threads=config.threads, exact=config.exact)
        draft = (
            LlamaModel(config.draft, n_ctx=config.n_ctx, threads=config.threads, exact=config.exact)
            if config.draft
            else None
        )
        ngram = NgramDrafter(config.ngram, domain) if config.ngram else None  # its conversation table is the slot's
        self.decoder = SpeculativeDecoder(self.target, draft, ngram)
        self.owner: str | None = None  # the caller whose conversation the KV cache holds

    def serve(self, caller: str | None, reuse_prefix: bool) -> None:
        """Keep the cached prompt only for the same caller: another caller must learn nothing of it, not even
        through how many tokens were reused or how fast the first token came."""
        if caller is None or caller != self.owner or not reuse_prefix:
            self.decoder.forget()
        self.owner = caller


def ngram_domain(config: ServeConfig) -> NgramTable | None:
    """The n-gram domain table every slot reads (built once, from the target's own tokenization of the answers)."""
    if config.ngram is None:
        return None
    answers = assistant_turns(config.ngram_data) if config.ngram_data else []
    tokenizer = LlamaModel(config.target, n_ctx=64, threads=1)  # its weights are mmapped: the slots' pages
    try:
        return domain_of_texts(config.ngram, answers, tokenizer.tokenize)
    finally:
        tokenizer.close()


def error_body(status: int, message: str, kind: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": status}}


def make_metrics(registry: CollectorRegistry) -> dict[str, Any]:
    latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
    return {
        "requests": Counter(
            "spectune_requests", "Requests by status (499: the caller hung up)", ["status"], registry=registry
        ),
        "ttft": Histogram(
            "spectune_ttft_seconds",
            "Time to first token as the caller sees it: from the request's arrival, the wait for a slot included",
            registry=registry,
            buckets=latency,
        ),
        "queue_wait": Histogram(
            "spectune_queue_wait_seconds", "Time a request waited for a slot", registry=registry, buckets=latency
        ),
        "tps": Histogram(
            "spectune_tokens_per_second",
            "Decode tokens/s per request",
            registry=registry,
            buckets=(5, 10, 20, 40, 80, 160, 320, 640, 1280),
        ),
        "acceptance": Gauge("spectune_acceptance_rate", "Acceptance rate of the last request", registry=registry),
        "accepted_len": Gauge("spectune_mean_accepted_len", "Tokens per target pass, last request", registry=registry),
        "queue": Gauge("spectune_queue_depth", "Requests waiting for a slot", registry=registry),
        "connections_closed": Counter(
            "spectune_connections_closed",
            "Connections the server closed: header_timeout, body_timeout, evicted (the oldest without a request, to "
            "make room past max_connections), full, answered_before_body",
            ["reason"],
            registry=registry,
        ),
        "slots_in_use": Gauge("spectune_slots_in_use", "Slots running a generation", registry=registry),
    }


class TooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read chunk by chunk so a chunked upload past `limit` is refused before it is all in memory."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise TooLarge
    return bytes(body)


class Server:
    """The slots, the metrics, the running generations and the request handling; `create_app` maps the routes."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.decoding = config.decoding()
        self.registry = CollectorRegistry()
        self.metrics = make_metrics(self.registry)
        self.slots: asyncio.Queue[Slot] = asyncio.Queue()
        domain = ngram_domain(config)
        for _ in range(config.slots):
            self.slots.put_nowait(Slot(config, domain))
        self.jobs: set[Job] = set()
        self.queued = 0  # requests waiting for a slot (with the jobs: the requests in progress)
        self.metrics["queue"].set_function(lambda: self.queued)  # the gauge reads the count, never a copy of it
        self.closing = False
        self.closed = asyncio.Event()  # wakes the requests waiting for a slot when the server stops
        self.loop: asyncio.AbstractEventLoop | None = None
        self.busy_since: float | None = None  # when the last free slot was taken
        # OpenAI's field for "which backend configuration produced this answer": the build and the setting.
        verdict = identity_verdict(config.target, config.exact)
        identity = "identical to the target alone" if verdict["guaranteed"] else "identity not guaranteed"
        self.fingerprint = f"{verdict['build']}; exact {'on' if config.exact else 'off'}; {identity}"

    def close(self) -> None:
        """The first stop signal: cancel every generation and refuse every queued and new request (503), from any
        thread (not from a signal handler: see SpectuneUvicorn); the generations end at their next step."""
        self.closing = True
        for job in list(self.jobs):
            job.aborted = True
            job.cancel.set()
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
        body = {"status": status, "slots_free": self.slots.qsize(), "slots": self.config.slots}
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
        except ClientDisconnect:  # hung up mid-upload, or cut by the server for its slowness: no answer can be sent
            if request.scope.get(BODY_TIMED_OUT):
                message = f"the request body did not arrive within {self.config.body_timeout:g} s"
                return self.fail(408, message, "request_timeout")
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
        """A free slot, waited for in arrival order; 503 past the queue timeout or when the server stops."""
        if self.closing:
            return self.fail(503, "the server is shutting down", "server_shutting_down")
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

    async def start(self, slot: Slot, chat: ChatRequest, arrived: float) -> Job | JSONResponse:
        """Tokenize the conversation in the slot and start its generation (or say why not). Whatever fails before
        the generation starts, the slot goes back."""
        try:
            messages = [m.for_template() for m in chat.messages]
            # Off the event loop: a long conversation must not hold up every other caller.
            prompt = await asyncio.to_thread(chat_tokens, slot.target, messages)
            room = slot.target.n_ctx - len(prompt)
            if room <= 1:
                self.release(slot)
                message = f"the conversation is {len(prompt)} tokens; the context holds {slot.target.n_ctx}"
                return self.fail(413, message, "context_length_exceeded", "messages")
            slot.serve(chat.user, self.config.reuse_prefix)
            job = Job(slot, prompt, self.sampling(chat, room), asyncio.get_running_loop(), self.config, arrived)
        except SpectuneError as exc:
            self.release(slot)
            return self.fail(400, str(exc), "invalid_request_error", "messages")
        except BaseException:  # anything else, cancellation included: the Guard answers 500 and counts it
            self.release(slot)
            raise
        self.jobs.add(job)

        def ended(_: Any) -> None:  # the slot is free exactly when its generation has ended
            self.jobs.discard(job)
            self.release(slot)

        job.done.add_done_callback(ended)
        job.start()
        if self.closing:  # stopped while this request was being tokenized
            job.cancel.set()
        return job

    async def completions(self, request: Request) -> Any:
        arrived = time.perf_counter()
        chat = await self.parse(request)
        if isinstance(chat, JSONResponse):
            return chat
        slot = await self.take_slot(request)
        if isinstance(slot, JSONResponse):
            return slot
        self.metrics["queue_wait"].observe(time.perf_counter() - arrived)
        job = await self.start(slot, chat, arrived)
        if isinstance(job, JSONResponse):
            return job
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
            "spectune": stats_json(generation.stats),
        }

    async def stream(self, job: Job, chat: ChatRequest, request: Request) -> AsyncIterator[bytes]:
        pending = ""
        finished = False
        continuous = chat.stream_options is not None and chat.stream_options.continuous_usage_stats
        counted: dict[str, Any] | None = None  # the usage as of the last text read
        yield sse(self.chunk(job, {"role": "assistant", "content": ""}, None))
        try:
            while (item := await job.queue.get()) is not None:
                if await request.is_disconnected():
                    job.cancel.set()
                text, counted = item
                pending += text
                cut = max((m.end() for m in CLAUSE_END.finditer(pending)), default=0)
                piece, pending = (pending[:cut], pending[cut:]) if chat.chunking == "sentence" else (pending, "")
                if piece:
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
            final["spectune"] = stats_json(generation.stats)
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

    def record(self, job: Job, stats: Stats) -> None:
        self.metrics["requests"].labels(status="200").inc()
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


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


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
        "ngram_drafted",
        "ngram_accepted",
    )
    values = stats.as_dict()
    return {key: values[key] for key in keys}


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
        def on_text(text: str) -> bool:
            if text:
                self._call(self.queue.put_nowait, (text, usage(self.slot.decoder.progress)))
            if time.monotonic() > self.deadline:
                self.timed_out = True
            return not (self.cancel.is_set() or self.timed_out)

        self.started = time.perf_counter()
        try:
            result = self.slot.decoder.generate(self.prompt, self.sampling, on_text, self.first_words)
        except Exception as exc:  # surfaces in the request that waits for it
            self._call(self._finish, None, exc)
        else:
            self._call(self._finish, result, None)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(result)
        self.queue.put_nowait(None)

    async def result(self) -> Generation:
        return await asyncio.shield(self.done)


class SpectuneUvicorn(uvicorn.Server):
    """uvicorn's server, told of the stop signal as it comes: the first SIGINT or SIGTERM cancels the running
    generations and refuses the queued requests at once, instead of waiting for every answer to finish."""

    def __init__(self, config: uvicorn.Config, server: Server) -> None:
        super().__init__(config)
        self.spectune = server

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler can interrupt the loop's thread anywhere, even inside a lock close() takes (a second
        # Ctrl-C during the first one's close() deadlocked): the cancelling runs on the loop, right after this.
        self.spectune.closing = True
        if self.spectune.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                self.spectune.loop.call_soon_threadsafe(self.spectune.close)
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """Stop as a signal would (tests, embedding)."""
        self.spectune.close()
        self.should_exit = True


def make_uvicorn(config: ServeConfig, host: str | None = None, port: int | None = None, **options: Any) -> Any:
    """The spectune app in uvicorn with the server's connection limits."""
    app = create_app(config)
    closed = app.state.server.metrics["connections_closed"]
    protocol = guarded_protocol(
        config.header_timeout,
        config.body_timeout,
        config.max_connections,
        lambda reason: closed.labels(reason=reason).inc(),
    )
    settings = uvicorn.Config(
        app,
        host=host or config.host,
        port=config.port if port is None else port,
        http=protocol,
        limit_concurrency=None,  # uvicorn would count idle connections too: see serve/connections.py
        timeout_keep_alive=config.keep_alive,
        **options,
    )
    return SpectuneUvicorn(settings, app.state.server)


def serve_in_thread(config: ServeConfig, host: str = "127.0.0.1") -> tuple[Any, threading.Thread, str]:
    """Start the server on a free port in a background thread (tests, benchmarks, embedding);
    returns (uvicorn server, thread, base URL). Stop it with `server.stop()`."""
    port = free_port(host)
    server = make_uvicorn(config, host, port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"the server did not start on {host}:{port}")
    return server, thread, f"http://{host}:{port}"
