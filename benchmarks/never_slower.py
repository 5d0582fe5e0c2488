"""Is `spectune serve` ever slower than llama-server? Both through HTTP on loopback, on the same target GGUF, threads
and context, one request at a time, interleaved prompt by prompt (the order turns each prompt):

- spectune serve as a user starts it (--mode auto: it measures at start whether the draft pays here);
- llama-server at its own defaults, the target alone (what a user who skips spectune runs);
- spectune serve --mode speculative (where the draft pays, and that its answers stay the target alone's: each is
  compared with the target's own greedy answer at the exact settings, decoded in-process before the timing).

Decode speed per answer: the tokens of its text after the first over the time from the first streamed text to the
last (the first token is a prefill on both engines; an end token streams no text and is counted on neither). A
prompt where any server decoded over 3x slower than its median is timed again, once, on every server (listed in
the report). Per server: the median of the per-prompt speeds and the totals behind them; the ratios to
llama-server per prompt (median) and over the totals.

Usage: python benchmarks/never_slower.py --target T.gguf [--draft D.gguf [--draft-max K]] --data FILE --name NAME
       [--n 30] [--max-tokens 64] [--ignore-eos]
Writes benchmarks/results/never_slower_NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from spectune.bench.stalls import over_median
from spectune.data.prepare import read_prompts
from spectune.engines.llama_server import LlamaServer, free_port
from spectune.runtime.build import build_name
from spectune.runtime.chat import chat_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.serve.config import ServeConfig
from spectune.serve.engine import READY_SECONDS, start_llama_server

RESULTS = Path(__file__).parent / "results"
LLAMA_SERVER = "llama-server, defaults"
SPECULATIVE = "spectune serve --mode speculative"


class Client(httpx.Client):
    """A server's client, with the target's tokenizer: both engines' answers are counted the same way, by the
    tokens of the text they streamed (llama-server's usage counts an end token it streams no text for; ours not)."""

    def __init__(self, url: str, tokenize: Callable[[str], list[int]], ignore_eos: bool) -> None:
        super().__init__(base_url=url, timeout=600)
        self.tokenize, self.ignore_eos = tokenize, ignore_eos


def streamed(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed answer as the caller reads it: its text, when the request went and its first and last text came
    (perf_counter), the last usage reported and the server's own statistics (spectune's `spectune`, llama-server's
    `timings`), if any."""
    start = time.perf_counter()
    first = last = None
    text, usage, stats = "", {}, {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if piece:
                last = time.perf_counter()
                first = first or last
                text += piece
            usage, stats = chunk.get("usage") or usage, chunk.get("spectune") or chunk.get("timings") or stats
    return {"text": text, "start": start, "first": first, "last": last, "usage": usage, "reported": stats}


def timed_answer(client: Client, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy answer: its text, tokens (of its text), time to first text and decode span."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": client.ignore_eos,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = streamed(client, body)
    text, first, last, start = answer["text"], answer["first"], answer["last"], answer["start"]
    span = (last - first) if first and last else 0.0
    tokens = len(client.tokenize(text)) if text else 0
    ttft_ms = 1000 * ((first or start) - start)
    reported = answer["usage"].get("completion_tokens", 0)
    return {"text": text, "tokens": tokens, "usage_tokens": reported, "ttft_ms": ttft_ms, "decode_seconds": span}


@contextmanager
def servers(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Every server of the comparison, each its own process as a user runs it (a server inside this process would
    share its interpreter lock with the client reading the streams), up together (idle ones cost nothing)."""
    shared = ["--target", str(args.target), "--n-ctx", "2048", "--threads", str(args.threads)]
    shared += ["--max-tokens", str(args.max_tokens)]
    modes = {"auto": ["--mode", "auto"]}
    if args.draft:
        modes = {mode: ["--draft", str(args.draft), "--mode", mode] for mode in ("auto", "speculative")}
        modes = {mode: [*flags, "--draft-max", args.draft_max] for mode, flags in modes.items()}
    with ExitStack() as stack:
        urls = {}
        for mode, own in modes.items():
            port = free_port()
            command = [str(Path(sys.executable).parent / "spectune"), "serve", *shared, *own, "--port", str(port)]
            command += ["--calibration-data", str(args.data), "--queue-timeout", "600"]
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            server = stack.enter_context(LlamaServer(command, {}, f"http://127.0.0.1:{port}", log))
            server.wait_ready(READY_SECONDS)
            urls[f"spectune serve --mode {mode}"] = server.url
        llama = ServeConfig(
            target=args.target, n_ctx=2048, threads=args.threads, max_tokens=args.max_tokens, engine="llama.cpp",
            port=free_port(), exact=False, draft_max=0,
        )  # fmt: skip
        log = stack.enter_context(tempfile.TemporaryFile("w+"))
        urls[LLAMA_SERVER] = stack.enter_context(start_llama_server(llama, log)).url
        for label, url in urls.items():
            health = httpx.get(f"{url}/health").json()
            print(f"{label}: {health.get('mode', 'llama.cpp')} ({health.get('mode_reason', 'its defaults')})")
        yield urls


def target_answers(model: LlamaModel, conversations: list[list[dict[str, str]]], settings: DecodeSettings) -> list[str]:
    """The target alone's greedy answers at the exact settings: what speculative answers must equal."""
    decoder = SpeculativeDecoder(model)
    return [decoder.generate(chat_tokens(model, messages), settings).text for messages in conversations]


def one_prompt(
    clients: dict[str, Client], index: int, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, dict[str, Any]]:
    """Every server's answer to one prompt, in an order that turns with the prompt's index."""
    labels = list(clients)
    runs = {}
    for label in labels[index % len(labels) :] + labels[: index % len(labels)]:
        run = timed_answer(clients[label], messages, max_tokens)
        run["tokens_per_second"] = (run["tokens"] - 1) / run["decode_seconds"] if run["decode_seconds"] else 0.0
        runs[label] = run
    print(f"prompt {index + 1}: " + "  ".join(f"{label} {runs[label]['tokens_per_second']:.1f}" for label in labels))
    return runs


def stalled(runs: dict[str, list[dict[str, Any]]]) -> list[int]:
    """Prompts where a server's seconds per token were over 3x its median (bench/stalls.py's rule)."""
    count = len(next(iter(runs.values())))
    per_prompt = [
        {
            label: 1 / answers[i]["tokens_per_second"]
            for label, answers in runs.items()
            if answers[i]["tokens_per_second"]
        }
        for i in range(count)
    ]
    return sorted(over_median(per_prompt))


def shown(path: Path) -> str:
    """A path as the result records it: under the home folder from ~, else relative to here (no machine's paths)."""
    resolved = path.resolve()
    if resolved.is_relative_to(Path.home()):
        return f"~/{resolved.relative_to(Path.home())}"
    return os.path.relpath(resolved)


def summary(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["tokens_per_second"] for r in runs]
    tokens, seconds = sum(r["tokens"] - 1 for r in runs), sum(r["decode_seconds"] for r in runs)
    base_tokens, base_seconds = sum(r["tokens"] - 1 for r in baseline), sum(r["decode_seconds"] for r in baseline)
    ratios = [r["tokens_per_second"] / b["tokens_per_second"] for r, b in zip(runs, baseline, strict=True)]
    return {
        "median_tokens_per_second": statistics.median(rates),
        "decode_tokens": tokens,
        "decode_seconds": seconds,
        "total_tokens_per_second": tokens / seconds,
        "median_ratio_to_llama_server": statistics.median(ratios),
        "total_ratio_to_llama_server": (tokens / seconds) / (base_tokens / base_seconds),
        "median_ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--name", required=True, help="Suffix of the results file: never_slower_NAME.json.")
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens")
    parser.add_argument("--draft-max", default="auto", help="k of the spectune servers (a run's pair.json has it)")
    args = parser.parse_args()
    conversations = [prompt.messages for prompt in read_prompts(args.data)[: args.n]]
    model = LlamaModel(args.target, n_ctx=2048, threads=args.threads, exact=True)
    settings = DecodeSettings(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    expected = target_answers(model, conversations, settings) if args.draft else []
    with servers(args) as urls:
        clients = {
            label: Client(url, lambda text: model.tokenize(text, special=False), args.ignore_eos)
            for label, url in urls.items()
        }
        labels, runs = list(urls), {label: [] for label in urls}
        for client in clients.values():  # warm-up: page faults, the first wake of each engine's threads
            timed_answer(client, conversations[0], 8)
        for index, messages in enumerate(conversations):
            for label, run in one_prompt(clients, index, messages, args.max_tokens).items():
                runs[label].append(run)
        retimed = stalled(runs)
        for index in retimed:  # timed again, once, all servers: the report lists them
            for label, run in one_prompt(clients, index, conversations[index], args.max_tokens).items():
                runs[label][index] = run
        modes = {label: httpx.get(f"{url}/health").json().get("mode") for label, url in urls.items()}
    valid = [i for i in range(len(conversations)) if all(runs[label][i]["tokens"] > 1 for label in labels)]
    kept = {label: [runs[label][i] for i in valid] for label in labels}
    report = {
        "target": shown(args.target),
        "draft": shown(args.draft) if args.draft else None,
        "data": shown(args.data),
        "n": len(conversations),
        "timed_prompts": len(valid),  # answers of one token have no decode span
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "draft_max": args.draft_max,
        "ignore_eos": args.ignore_eos,
        "build": build_name(),
        "modes": modes,
        "retimed": [index + 1 for index in retimed],  # prompts timed again after a stall (numbered from 1)
        "still_stalled": [index + 1 for index in stalled(runs)],
        "servers": {label: summary(kept[label], kept[LLAMA_SERVER]) for label in labels},
        "speculative_identical": sum(
            run["text"] == answer for run, answer in zip(runs.get(SPECULATIVE, []), expected, strict=False)
        ),
        "prompts": {label: [{k: v for k, v in run.items() if k != "text"} for run in runs[label]] for label in labels},
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"never_slower_{args.name}.json"
    out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {out}")


def print_table(report: dict[str, Any]) -> None:
    header = f"{'server':34} {'mode':12} {'median tok/s':>12} {'total tok/s':>11} {'x llama-server':>14}"
    print(f"\n{header} {'(median)':>9}")
    for label, row in report["servers"].items():
        mode = report["modes"].get(label) or "-"
        print(
            f"{label:34} {mode:12} {row['median_tokens_per_second']:12.1f} {row['total_tokens_per_second']:11.1f} "
            f"{row['total_ratio_to_llama_server']:14.3f} {row['median_ratio_to_llama_server']:9.3f}"
        )
    if report["draft"]:
        print(f"speculative answers identical to the target alone's: {report['speculative_identical']}/{report['n']}")


if __name__ == "__main__":
    main()
