"""`spectune serve --engine llama.cpp`: the same pair, k, threads and exact settings handed to llama.cpp's own
`llama-server` (built from the pinned sources), supervised until Ctrl-C, SIGTERM or its own exit."""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import IO

from spectune.engines.llama_cpp import SERVER, built_tool
from spectune.engines.llama_server import LlamaServer, server_command, server_env
from spectune.export.llama_flags import check_command
from spectune.serve.config import ServeConfig
from spectune.threads import thread_count

READY_SECONDS = 300.0  # a 12B GGUF takes a while to map on a cold disk


def start_llama_server(config: ServeConfig, log: IO[str] | None = None, ready: float = READY_SECONDS) -> LlamaServer:
    """llama-server on the config's pair, ready to answer (its /health is 200)."""
    assert config.target is not None  # ServeConfig's validator sees to it
    command = server_command(
        config.llama_server or built_tool(SERVER),
        config.target,
        config.draft,
        config,
        thread_count(config.threads),
        host=config.host,
        port=config.port,
        n_ctx=config.n_ctx,
        slots=config.slots,
        model_name=config.model_name,
        exact=config.exact,
        lookups=config.lookups(config.ngram is not None),
        ngram=config.ngram,
        gpu_layers=config.gpu_layers,
    )
    check_command(command)  # a flag the pinned llama.cpp does not know fails here, not in the child
    host = f"[{config.host}]" if ":" in config.host else config.host
    server = LlamaServer(command, server_env(config.exact, config.api_key), f"http://{host}:{config.port}", log)
    server.wait_ready(ready)
    return server


def serve_llama_cpp(config: ServeConfig, announce: Callable[[str], None]) -> int:
    """Run llama-server until it exits or spectune is told to stop; the child never outlives this call."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with start_llama_server(config) as server:
            announce(f"llama-server ready at {server.url}/v1 (pid {server.process.pid}); Ctrl-C stops it")
            try:
                return server.process.wait()
            except KeyboardInterrupt:
                return server.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
