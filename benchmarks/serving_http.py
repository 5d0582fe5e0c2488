"""The servers a serving bench measures and how it asks them: `spectune serve` as a user starts it (two tenants'
keys) and, with a draft, `--mode speculative`, beside llama-server at its defaults on the same GGUF, threads, slots
and context, each its own process; one streamed answer as a caller reads it; prompts timed in turns, stalls again."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from spectune.bench.stalls import over_median
from spectune.engines.llama_server import LlamaServer, free_port
from spectune.serve.config import ServeConfig
from spectune.serve.engine import READY_SECONDS, start_llama_server

SPECTUNE, SPECULATIVE, LLAMA = "spectune serve", "spectune serve --mode speculative", "llama-server, defaults"
OTHER_TENANT = "other tenant"  # spectune serve under the second key
KEYS = ("sk-bench-tenant-one", "sk-bench-tenant-two")
N_CTX = 4096
Messages = list[dict[str, str]]


def spectune_command(args: argparse.Namespace, port: int, mode: str) -> list[str]:
    command = [str(Path(sys.executable).parent / "spectune"), "serve", "--target", str(args.target), "--mode", mode]
    command += ["--n-ctx", str(N_CTX), "--threads", str(args.threads), "--slots", str(args.slots), "--port", str(port)]
    command += ["--api-key", ",".join(KEYS), "--queue-timeout", "600", "--calibration-data", str(args.data)]
    return command + (["--draft", str(args.draft), "--draft-max", args.draft_max] if args.draft else [])


@contextmanager
def servers(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Every server, each its own process as a user runs it (in this process one would share the interpreter lock
    with the client reading the streams), up together: idle ones cost nothing. Their URLs by label."""
    with ExitStack() as stack:
        urls = {}
        for label, mode in {SPECTUNE: "auto", **({SPECULATIVE: "speculative"} if args.draft else {})}.items():
            port, log = free_port(), stack.enter_context(tempfile.TemporaryFile("w+"))
            command = spectune_command(args, port, mode)
            server = stack.enter_context(LlamaServer(command, {}, f"http://127.0.0.1:{port}", log))
            server.wait_ready(READY_SECONDS)
            urls[label] = server.url
        llama = ServeConfig(
            target=args.target, n_ctx=N_CTX, threads=args.threads, slots=args.slots, engine="llama.cpp",
            port=free_port(), exact=False, draft_max=0,
        )  # fmt: skip
        urls[LLAMA] = stack.enter_context(
            start_llama_server(llama, stack.enter_context(tempfile.TemporaryFile("w+")))
        ).url
        yield urls


def key_of(label: str) -> str | None:
    """The API key a server's callers send: spectune's first tenant's; llama-server takes none."""
    return None if label == LLAMA else KEYS[0]


def client(url: str, key: str | None) -> httpx.Client:
    """A connection per request, as each engine closes idle ones on its own clock (a reused one it had just closed
    failed the request); on loopback a connection costs well under a millisecond."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, timeout=600, headers=headers, limits=httpx.Limits(max_keepalive_connections=0))


def clients_of(urls: dict[str, str]) -> dict[str, httpx.Client]:
    """A client per server (llama-server takes no key), and spectune's under the second tenant's key."""
    out = {label: client(url, key_of(label)) for label, url in urls.items()}
    return out | {OTHER_TENANT: client(urls[SPECTUNE], KEYS[1])}


def ask(http: httpx.Client, messages: Messages, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """One streamed greedy answer as the caller reads it: its text, time to first text, decode span, the usage the
    server reported and its stages before the first token (spectune's `stages`, llama-server's prompt time)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    first = last = None
    text, usage, reported = "", {}, {}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
                text += chunk["choices"][0]["delta"]["content"]
            usage, reported = chunk.get("usage") or usage, chunk.get("spectune") or chunk.get("timings") or reported
    stages = {"prefill_seconds": reported["prompt_ms"] / 1000} if "prompt_ms" in reported else reported.get("stages")
    return {
        "text": text,
        "ttft_ms": 1000 * ((first or start) - start),
        "decode_seconds": (last - first) if first and last else 0.0,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "stages": stages or {},
    }


def in_turn(labels: list[str], index: int) -> list[str]:
    """The labels in an order that turns with the prompt's index (interleaved: no engine always goes first)."""
    return labels[index % len(labels) :] + labels[: index % len(labels)]


def stalled(per_prompt: list[dict[str, float]]) -> list[int]:
    """Prompts where a side's time was over 3x its median (bench/stalls.py's rule)."""
    return sorted(over_median(per_prompt))


def timed_passes(one: Callable[[int], dict], count: int, times: Callable[[dict], dict[str, float]]) -> dict:
    """Every prompt once, then each one a side stalled on once again: the rows and what was re-timed."""
    rows = [one(index) for index in range(count)]
    retimed = stalled([times(row) for row in rows])
    for index in retimed:
        rows[index] = one(index)
    still = stalled([times(row) for row in rows])
    return {"rows": rows, "retimed": [i + 1 for i in retimed], "still_stalled": [i + 1 for i in still]}


def shown(path: Path) -> str:
    """A path as the report records it: under the home folder from ~, else relative to here (no machine's paths)."""
    resolved = path.resolve()
    return (
        f"~/{resolved.relative_to(Path.home())}" if resolved.is_relative_to(Path.home()) else os.path.relpath(resolved)
    )
