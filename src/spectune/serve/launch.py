"""Starting the server: uvicorn with spectune's connection limits and its stop-signal handling, in the foreground
(`spectune serve`) or in a thread (tests, benchmarks, embedding)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import uvicorn

from spectune.engines.llama_server import free_port
from spectune.serve.app import Server, create_app
from spectune.serve.config import ServeConfig
from spectune.serve.connections import fit_connections, guarded_protocol


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
    server = app.state.server
    # after the models are loaded: their descriptors are counted as open
    cap, file_limit = fit_connections(config.max_connections, "max_connections" in config.model_fields_set)
    server.connection_limits = {"max_connections": cap, "open_file_limit": file_limit}
    closed = server.metrics["connections_closed"]
    protocol = guarded_protocol(
        config.header_timeout,
        config.body_timeout,
        cap,
        config.api_key,
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
    return SpectuneUvicorn(settings, server)


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
