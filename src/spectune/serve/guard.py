"""What every request passes before a route runs: its API key and its size (declared, and read chunk by chunk by
the route); and what a failure or a forced quit leaves a caller with (a JSON error that /metrics counts, never
uvicorn's plain-text 500 and a traceback)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from starlette.requests import Request

from spectune.serve.config import ServeConfig
from spectune.serve.refusal import authorized


class Guarded(Protocol):
    """What the guard reads of the server it guards (serve/app.py's Server): its settings, whether it is stopping,
    and the error response that /metrics counts."""

    config: ServeConfig
    closing: bool

    def fail(
        self, status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None
    ) -> Any: ...


log = logging.getLogger("spectune.serve")


class Guard:
    """Authentication and the declared body size, checked before a route runs. A plain ASGI middleware: it hands the
    connection on untouched, so a handler still sees a caller hang up (Starlette's BaseHTTPMiddleware hides it)."""

    def __init__(self, app: Any, server: Guarded) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(scope, receive, send)
            return
        if scope["type"] == "http":
            config = self.server.config
            headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
            length = headers.get("content-length", "")
            refusal = None
            if (
                config.api_key
                and scope["path"] != "/health"
                and not authorized(headers.get("authorization"), config.api_key)
            ):
                refusal = self.server.fail(
                    401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error"
                )
            elif length.isdigit() and int(length) > config.max_request_bytes:
                message = f"request larger than {config.max_request_bytes} bytes"
                refusal = self.server.fail(413, message, "invalid_request_error")
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            # uvicorn's forced quit (a second Ctrl-C) cancels the requests in flight: a caller gets the JSON 503 of a
            # server shutting down where nothing was sent yet, never uvicorn's plain-text 500 and a traceback
            if not self.server.closing or scope["type"] != "http":
                raise
            if not started:
                with contextlib.suppress(Exception):
                    shutting = self.server.fail(503, "the server is shutting down", "server_shutting_down")
                    await shutting(scope, receive, send)
        except Exception as exc:  # a bug, not the caller's fault: a JSON 500 that /metrics counts, and the log
            log.exception("unhandled error in %s", scope.get("path"))
            if scope["type"] != "http" or started:
                raise
            await self.server.fail(500, f"internal error: {type(exc).__name__}", "server_error")(scope, receive, send)

    async def lifespan(self, scope: dict, receive: Any, send: Any) -> None:
        """A forced quit (a second Ctrl-C) cancels the lifespan's wait for the shutdown message: Starlette reports
        that as a failed shutdown with a traceback, though the generations are still cancelled and joined (the
        CLI's `serve`). Not a failure: nothing is logged."""

        async def sending(message: dict) -> None:
            if not (message["type"] == "lifespan.shutdown.failed" and self.server.closing):
                await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not self.server.closing:
                raise


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
