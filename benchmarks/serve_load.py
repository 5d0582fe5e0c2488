"""Load test on loopback of spectune's own server and llama.cpp's llama-server (`spectune serve --engine
llama.cpp`) on the same pair, slots, context and threads: N concurrent streaming clients, bounded in requests and
seconds, with and without the draft. Engines and variants take turns, round after round (interleaved); each figure
is the median over the rounds. Reports p50/p95/p99 time to first token, median tokens/s per stream, errors (must
be 0), and the TTFT of later turns of a conversation (prefix reuse).

Usage: python benchmarks/serve_load.py --target T.gguf --draft D.gguf --data FILE --name NAME [--engine both]
Writes benchmarks/results/serve_load_NAME.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from spectune.data.prepare import read_prompts
from spectune.engines.llama_server import free_port
from spectune.runtime.build import build_name
from spectune.serve.config import ServeConfig
from spectune.serve.engine import start_llama_server
from spectune.serve.launch import serve_in_thread

RESULTS = Path(__file__).parent / "results"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def one(client: httpx.AsyncClient, messages: list, max_tokens: int, user: str | None = None) -> dict:
    start = time.perf_counter()
    first = None
    completion = 0
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": user,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - start
            if "usage" in chunk:
                completion = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - start
    return {"ttft": first or total, "tokens": completion, "seconds": total}


async def load(url: str, prompts: list, clients: int, requests: int, max_tokens: int, seconds: float) -> list:
    queue = list(range(requests))
    results: list[dict] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while queue and time.perf_counter() < deadline:
                index = queue.pop()
                results.append(await one(client, prompts[index % len(prompts)].messages, max_tokens))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return results


async def conversation_ttft(url: str, prompts: list, turns: int, max_tokens: int) -> list[float]:
    """TTFT (ms) of turns 2.. of growing conversations, as a voice call has them, one client."""
    ttfts = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for call, prompt in enumerate(prompts):
            messages = list(prompt.messages)
            for turn in range(turns):
                result = await one(client, messages, max_tokens, user=f"call-{call}")  # a slot reuses a caller's prefix
                if turn:
                    ttfts.append(1000 * result["ttft"])
                body = {"messages": messages, "max_tokens": max_tokens, "user": f"call-{call}"}
                reply = await client.post("/v1/chat/completions", json=body)
                messages += [
                    {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"] or "Ok."},
                    {"role": "user", "content": "Thanks, and one more thing."},
                ]
    return ttfts


@contextmanager
def serving(engine: str, target: Path, draft: Path | None, args: argparse.Namespace, **own: Any) -> Iterator[str]:
    """A server of `engine` on the pair for the block; its URL. The same slots, context, threads and k for both;
    `own`: settings of spectune's server alone."""
    shared = {"target": target, "draft": draft, "slots": args.slots, "n_ctx": 2048, "threads": args.threads}
    shared["draft_max"] = own.pop("draft_max", None)
    if engine == "spectune":
        server, thread, url = serve_in_thread(ServeConfig(**shared, queue_timeout=60.0, **own))
        try:
            yield url
        finally:
            server.stop()
            thread.join(timeout=10)
        return
    config = ServeConfig(**shared, engine="llama.cpp", port=free_port())
    with tempfile.TemporaryFile("w+") as log, start_llama_server(config, log) as llama:
        yield llama.url


def summarize(results: list[dict]) -> dict:
    done = [r for r in results if "error" not in r]
    ttft = [1000 * r["ttft"] for r in done]
    return {
        "requests": len(results),
        "errors": len(results) - len(done),
        "p50_ttft_ms": percentile(ttft, 0.5),
        "p95_ttft_ms": percentile(ttft, 0.95),
        "p99_ttft_ms": percentile(ttft, 0.99),
        "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in done) if done else 0.0,
        "total_tokens": sum(r["tokens"] for r in done),
    }


def median_rounds(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds; counts summed."""
    summed = {"requests", "errors", "total_tokens"}
    return {key: (sum if key in summed else statistics.median)([r[key] for r in rounds]) for key in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--engine", choices=["spectune", "llama.cpp", "both"], default="both")
    parser.add_argument("--name", default="", help="Suffix of the results file: serve_load_NAME.json.")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2, help="Engines and variants take turns, round after round.")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    prompts = read_prompts(args.data)[:50]
    engines = ["spectune", "llama.cpp"] if args.engine == "both" else [args.engine]
    variants = {"target alone": None, "with draft": args.draft}
    rounds: dict[str, dict[str, list]] = {engine: {name: [] for name in variants} for engine in engines}
    for _ in range(args.rounds):
        for engine in engines:
            for name, draft in variants.items():
                with serving(engine, args.target, draft, args) as url:
                    results = asyncio.run(
                        load(url, prompts, args.clients, args.requests, args.max_tokens, args.seconds)
                    )
                rounds[engine][name].append(summarize(results))
                print(engine, name, rounds[engine][name][-1])
    report: dict[str, Any] = {
        "target": str(args.target),
        "draft": str(args.draft),
        "clients": args.clients,
        "slots": args.slots,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "build": build_name(),
        "engines": {
            engine: {name: median_rounds(r) for name, r in by_name.items()} for engine, by_name in rounds.items()
        },
        "multi_turn": multi_turn(engines, prompts, args),
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"serve_load{'_' + args.name if args.name else ''}.json"
    out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {out}")


def multi_turn(engines: list[str], prompts: list, args: argparse.Namespace) -> dict:
    """TTFT of later turns of a conversation: spectune with and without prefix reuse, llama.cpp with its default
    prompt cache."""
    cases = [
        (engine, f"{engine}, prefix reuse", {"reuse_prefix": True} if engine == "spectune" else {})
        for engine in engines
    ]
    if "spectune" in engines:
        cases.append(("spectune", "spectune, no reuse", {"reuse_prefix": False}))
    rows = {}
    for engine, label, own in cases:
        args_one_slot = argparse.Namespace(**{**vars(args), "slots": 1})
        with serving(engine, args.target, args.draft, args_one_slot, **own) as url:
            try:
                ttfts = asyncio.run(conversation_ttft(url, prompts[:4], 4, 16))
            except httpx.HTTPError as error:  # reported, not fatal: the load figures above still stand
                rows[label] = {"error": f"{type(error).__name__}: {error}"}
                print(label, rows[label])
                continue
        rows[label] = {
            "turns": len(ttfts),
            "p50_ttft_ms": percentile(ttfts, 0.5),
            "p95_ttft_ms": percentile(ttfts, 0.95),
        }
        print(label, rows[label])
    return rows


def print_table(report: dict) -> None:
    print(f"\n{'engine':10} {'variant':13} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'p95 ms':>7} {'tok/s':>7}")
    for engine, by_name in report["engines"].items():
        for name, row in by_name.items():
            print(
                f"{engine:10} {name:13} {row['requests']:8d} {row['errors']:6d} {row['p50_ttft_ms']:9.1f} "
                f"{row['p95_ttft_ms']:7.1f} {row['tokens_per_s']:7.1f}"
            )


if __name__ == "__main__":
    main()
