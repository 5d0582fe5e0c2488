"""Load test of `spectune serve` on loopback: N concurrent streaming clients, bounded in requests and seconds,
with and without the draft (two servers, one after the other, same prompts). Reports p50/p95/p99 time to first
token, tokens/s per stream, errors (must be 0), and that every request completed or got a clear error.

Usage: python benchmarks/serve_load.py --target T.gguf --draft D.gguf --data FILE --clients 4 --requests 24
Writes benchmarks/results/serve_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from spectune.data.prepare import read_prompts
from spectune.serve.app import ServeConfig, serve_in_thread

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    prompts = read_prompts(args.data)[:50]
    report = {"clients": args.clients, "slots": args.slots, "max_tokens": args.max_tokens, "variants": {}}
    for name, draft in (("target alone", None), ("with draft", args.draft)):
        config = ServeConfig(
            target=args.target, draft=draft, slots=args.slots, n_ctx=2048, threads=args.threads, queue_timeout=60.0
        )
        server, thread, url = serve_in_thread(config)
        results = asyncio.run(load(url, prompts, args.clients, args.requests, args.max_tokens, args.seconds))
        server.should_exit = True
        thread.join(timeout=10)
        done = [r for r in results if "error" not in r]
        ttft = [1000 * r["ttft"] for r in done]
        report["variants"][name] = {
            "requests": len(results),
            "errors": len(results) - len(done),
            "p50_ttft_ms": percentile(ttft, 0.5),
            "p95_ttft_ms": percentile(ttft, 0.95),
            "p99_ttft_ms": percentile(ttft, 0.99),
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in done) if done else 0.0,
        }
        print(name, report["variants"][name])
    report["multi_turn"] = {}
    for name, reuse in (("prefix reuse", True), ("no reuse", False)):
        server, thread, url = serve_in_thread(
            ServeConfig(
                target=args.target, draft=args.draft, slots=1, n_ctx=2048, threads=args.threads, reuse_prefix=reuse
            )
        )
        ttfts = asyncio.run(conversation_ttft(url, prompts[:4], 4, 16))
        server.should_exit = True
        thread.join(timeout=10)
        report["multi_turn"][name] = {
            "turns": len(ttfts),
            "p50_ttft_ms": percentile(ttfts, 0.5),
            "p95_ttft_ms": percentile(ttfts, 0.95),
        }
        print(name, report["multi_turn"][name])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_load.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
