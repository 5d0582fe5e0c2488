"""An OpenAI-compatible streaming server for voice bots: target + draft with speculative decoding.

POST /v1/chat/completions (stream or not), GET /v1/models, GET /health, GET /metrics (Prometheus).
N slots, each its own llama.cpp contexts; requests wait fairly (FIFO) for a slot and get 503 with Retry-After
past a bound; a client that disconnects stops its generation and frees its slot. A slot keeps its KV cache,
so the next turn of a conversation reuses the shared prompt prefix. `"chunking": "sentence"` streams whole
clauses for a TTS engine instead of token deltas.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from spectune.runtime.chat import chat_prompt
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SamplingConfig, SpeculativeDecoder, Stats

CLAUSE_END = re.compile(r"[.!?;:,](\s|$)")


@dataclass
class ServeConfig:
    target: Path
    draft: Path | None = None
    slots: int = 1
    n_ctx: int = 4096
    threads: int | None = None
    exact: bool = True
    draft_max: int = 8
    queue_timeout: float = 30.0
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    model_name: str = "spectune"
    reuse_prefix: bool = True  # keep a slot's KV cache for the next turn (off: every request prefills all)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty content")
        return value


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    chunking: Literal["token", "sentence"] = "token"


class Slot:
    def __init__(self, config: ServeConfig) -> None:
        self.target = LlamaModel(config.target, n_ctx=config.n_ctx, threads=config.threads, exact=config.exact)
        draft = (
            LlamaModel(config.draft, n_ctx=config.n_ctx, threads=config.threads, exact=config.exact)
            if config.draft
            else None
        )
        self.decoder = SpeculativeDecoder(self.target, draft)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": status}}


def create_app(config: ServeConfig) -> FastAPI:
    registry = CollectorRegistry()
    metrics = {
        "requests": Counter("spectune_requests", "Requests by status", ["status"], registry=registry),
        "ttft": Histogram(
            "spectune_ttft_seconds",
            "Time to first token",
            registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
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
    }
    slots: asyncio.Queue[Slot] = asyncio.Queue()
    for _ in range(config.slots):
        slots.put_nowait(Slot(config))
    app = FastAPI(title="spectune", version="1")

    def fail(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None) -> Any:
        metrics["requests"].labels(status=str(status)).inc()
        code, body = error_body(status, message, kind, param)
        return JSONResponse(body, status_code=code, headers=headers)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        authorized = request.headers.get("authorization") == f"Bearer {config.api_key}"
        if config.api_key and request.url.path != "/health" and not authorized:
            return fail(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        length = request.headers.get("content-length")
        if length and int(length) > config.max_request_bytes:
            return fail(413, f"request larger than {config.max_request_bytes} bytes", "invalid_request_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "slots_free": slots.qsize(), "slots": config.slots}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "owned_by": "spectune"}]}

    @app.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > config.max_request_bytes:
            return fail(413, f"request larger than {config.max_request_bytes} bytes", "invalid_request_error")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return fail(400, f"malformed JSON: {exc}", "invalid_request_error")
        if isinstance(body, dict) and isinstance(body.get("extra_body"), dict):
            body = {**body, **body["extra_body"]}
        try:
            chat = ChatRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(part) for part in first["loc"])
            return fail(
                422 if first["type"] != "missing" else 400, f"{param}: {first['msg']}", "invalid_request_error", param
            )
        metrics["queue"].inc()
        try:
            slot = await asyncio.wait_for(slots.get(), timeout=config.queue_timeout)
        except TimeoutError:
            return fail(
                503,
                "all slots are busy; retry shortly",
                "server_busy",
                headers={"Retry-After": str(max(1, int(config.queue_timeout)))},
            )
        finally:
            metrics["queue"].dec()
        try:
            prompt = slot.target.tokenize(chat_prompt(slot.target, [m.model_dump() for m in chat.messages]))
        except Exception:
            slots.put_nowait(slot)
            raise
        room = slot.target.n_ctx - len(prompt)
        if room <= 1:
            slots.put_nowait(slot)
            return fail(
                413,
                f"the conversation is {len(prompt)} tokens; the context holds {slot.target.n_ctx}",
                "context_length_exceeded",
                "messages",
            )
        wanted = chat.max_completion_tokens or chat.max_tokens or room - 1
        sampling = SamplingConfig(
            max_tokens=min(wanted, room - 1),
            temperature=chat.temperature,
            top_p=chat.top_p,
            seed=chat.seed if chat.seed is not None else 0,
            draft_max=config.draft_max,
            stop=[chat.stop] if isinstance(chat.stop, str) else list(chat.stop or []),
        )
        if not config.reuse_prefix:
            slot.target.truncate(0)
        job = Job(slot, prompt, sampling, asyncio.get_running_loop())
        # The slot is free exactly when its generation has ended, however the request ends.
        job.done.add_done_callback(lambda _: slots.put_nowait(slot))
        job.start()
        if chat.stream:
            return StreamingResponse(stream(job, chat, request), media_type="text/event-stream")
        tokens, stats = await job.result()
        record(stats)
        metrics["requests"].labels(status="200").inc()
        return {
            "id": job.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": config.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": slot.target.detokenize(tokens)},
                    "finish_reason": finish(stats),
                }
            ],
            "usage": usage(stats),
            "spectune": stats_json(stats),
        }

    async def stream(job: Job, chat: ChatRequest, request: Request) -> AsyncIterator[bytes]:
        target = job.slot.target
        emitted: list[int] = []
        sent_text = ""
        pending = ""
        first = {"role": "assistant", "content": ""}
        yield sse(chunk(job, first, None))
        try:
            while True:
                item = await job.queue.get()
                if await request.is_disconnected():
                    job.cancel.set()
                if item is None:
                    break
                emitted += item
                text = target.detokenize(emitted)
                pending += text[len(sent_text) :]
                sent_text = text
                if chat.chunking == "sentence":
                    cut = max((m.end() for m in CLAUSE_END.finditer(pending)), default=0)
                    piece, pending = pending[:cut], pending[cut:]
                else:
                    piece, pending = pending, ""
                if piece:
                    yield sse(chunk(job, {"content": piece}, None))
            _, stats = await job.result()
            if pending:
                yield sse(chunk(job, {"content": pending}, None))
            record(stats)
            metrics["requests"].labels(status="200").inc()
            final = chunk(job, {}, finish(stats))
            final["usage"] = usage(stats)
            final["spectune"] = stats_json(stats)
            yield sse(final)
            yield b"data: [DONE]\n\n"
        finally:
            job.cancel.set()  # a client gone mid-stream stops the generation, which frees the slot

    def record(stats: Stats) -> None:
        metrics["ttft"].observe(stats.ttft_seconds)
        metrics["tps"].observe(stats.tokens_per_second)
        metrics["acceptance"].set(stats.acceptance_rate)
        metrics["accepted_len"].set(stats.mean_accepted_len)

    def chunk(job: Job, delta: dict, reason: str | None) -> dict[str, Any]:
        return {
            "id": job.id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": config.model_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        }

    return app


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def finish(stats: Stats) -> str:
    return "stop" if stats.finish_reason in ("stop", "cancelled") else "length"


def usage(stats: Stats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt_tokens + stats.generated,
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
        "draft_seconds",
        "verify_seconds",
    )
    values = stats.as_dict()
    return {key: values[key] for key in keys}


class Job:
    """One generation on a worker thread; its tokens come back through an asyncio queue."""

    def __init__(self, slot: Slot, prompt: list[int], sampling: SamplingConfig, loop: asyncio.AbstractEventLoop):
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.slot, self.prompt, self.sampling, self.loop = slot, prompt, sampling, loop
        self.queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self.cancel = threading.Event()
        self.done: asyncio.Future = loop.create_future()

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        def on_tokens(tokens: list[int]) -> bool:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, list(tokens))
            return not self.cancel.is_set()

        try:
            result = self.slot.decoder.generate(self.prompt, self.sampling, on_tokens)
        except Exception as exc:  # surfaces in the request that waits for it
            self.loop.call_soon_threadsafe(self._finish, None, exc)
        else:
            self.loop.call_soon_threadsafe(self._finish, result, None)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(result)
        self.queue.put_nowait(None)

    async def result(self) -> tuple[list[int], Stats]:
        return await asyncio.shield(self.done)


def serve_in_thread(config: ServeConfig, host: str = "127.0.0.1") -> tuple[Any, threading.Thread, str]:
    """Start the server on a free port in a background thread (tests, benchmarks, embedding);
    returns (uvicorn server, thread, base URL). Stop it with `server.should_exit = True`."""
    import socket

    import uvicorn

    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"the server did not start on {host}:{port}")
    return server, thread, f"http://{host}:{port}"
