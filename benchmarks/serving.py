"""Serving measured from outside, as a voice bot meets it: `spectune serve` as a user starts it and llama-server at
its defaults on the same GGUF, threads, slots and context, started once; every measurement runs against those servers
through HTTP on loopback, engines taking turns prompt by prompt, and lands in one report:

- **decode**: each server's streamed greedy answer to each prompt; decode speed is the tokens of its text after the
  first over the time from the first text to the last (the first token is a prefill on both engines). With --draft,
  `spectune serve --mode speculative` as well, its answers compared with the target alone's (decoded in-process).
- **first_token**: SGD dialogues behind one operator system prompt of a few hundred tokens (the same for every
  caller, as a bot's persona and policies are): a new caller's first turn; the same caller's next turn, sent half a
  second after its answer; spectune only: that turn's words sent as they come (max_tokens 0, a partial transcript
  each 300 ms or more, at most 8), then the final request, timed from it and compared with llama-server's returning
  caller; the same with the last word late; every fifth dialogue, another tenant (the second API key, a fresh
  cache_salt), which must reuse nothing. spectune's slots are free before each timed request. --passes times over
  the dialogues; medians over all, and per pass.
- **load**: --clients concurrent streaming callers against each server in turn, --requests each, --rounds times;
  p50/p95 time to first token, median tokens/s per stream, errors (must be 0).
- **audio**: `spectune call --speak` on --calls dialogues piped in line by line: from the end of the caller's turn
  to the first audio sample espeak-ng makes of the answer.

A prompt where a server was over 3x its median (time per token; time to first token, per kind of turn) is timed again,
once; the report lists it.

Usage: python benchmarks/serving.py --target T.gguf --data dev.jsonl --name NAME [--draft D.gguf [--draft-max K]]
       [--measure decode first_token load audio] [--n 30] [--passes 3] [--threads 2] [--slots 1]
Writes benchmarks/results/serving_NAME.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from serving_http import (
    KEYS,
    LLAMA,
    N_CTX,
    OTHER_TENANT,
    SPECTUNE,
    Messages,
    ask,
    clients_of,
    in_turn,
    key_of,
    servers,
    shown,
    timed_passes,
)

from spectune.atomic import atomic_path
from spectune.data.prepare import read_prompts
from spectune.data.read import read_dialogues
from spectune.runtime.build import build_name
from spectune.runtime.chat import chat_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder

RESULTS = Path(__file__).parent / "results"
MEASURES = ("decode", "first_token", "load", "audio")
LISTEN_SECONDS = 0.5  # between an answer and the caller's next turn: the caller hears the answer and speaks
PARTIAL_GAP_SECONDS = 0.3
CALL_TOKENS = 24  # first_token: answers this long at most (what is timed is their first token)
TURN_LINE = re.compile(r"first words after (\d+) ms.*; first audio (\d+) ms after your turn")  # `spectune call`
# An operator's system prompt of a few hundred tokens, the same for every caller (persona, policies)
SYSTEM_PROMPT = (Path(__file__).parent / "data" / "operator_prompt.txt").read_text().strip()

# decode ---------------------------------------------------------------------------------------------------------


def decode(http: dict[str, httpx.Client], conversations: list[Messages], model: LlamaModel, args: Any) -> dict:
    labels = [label for label in http if label != OTHER_TENANT]

    def one(index: int) -> dict[str, dict[str, Any]]:
        runs = {}
        for label in in_turn(labels, index):
            run = ask(http[label], conversations[index], args.max_tokens, ignore_eos=args.ignore_eos)
            run["tokens"] = len(model.tokenize(run["text"], special=False)) if run["text"] else 0
            run["tokens_per_second"] = (run["tokens"] - 1) / run["decode_seconds"] if run["decode_seconds"] else 0.0
            runs[label] = run
        print(f"decode {index + 1}: " + "  ".join(f"{k} {v['tokens_per_second']:.1f}" for k, v in runs.items()))
        return runs

    for label in labels:  # warm-up: page faults, the first wake of each engine's threads
        ask(http[label], conversations[0], 8)
    timed = timed_passes(one, len(conversations), lambda row: {k: 1 / v["tokens_per_second"] for k, v in row.items()
                                                                if v["tokens_per_second"]})  # fmt: skip
    rows = timed.pop("rows")
    kept = [row for row in rows if all(run["tokens"] > 1 for run in row.values())]  # one token: no decode span
    settings = DecodeSettings(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    # what speculative answers must equal: the target alone's at the exact settings, decoded here
    expected = [SpeculativeDecoder(model).generate(chat_tokens(model, m), settings).text for m in conversations]
    return timed | {
        "n": len(conversations),
        "timed_prompts": len(kept),
        "servers": {
            label: decode_summary([row[label] for row in kept], [row[LLAMA] for row in kept]) for label in labels
        },
        "identical_to_the_target_alone": {
            label: sum(row[label]["text"] == answer for row, answer in zip(rows, expected, strict=True))
            for label in labels
        },
        "prompts": [
            {label: {k: v for k, v in run.items() if k != "text"} for label, run in row.items()} for row in rows
        ],
    }


def decode_summary(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server: the median per-prompt speed and the totals behind it, and the ratios to llama-server's per prompt
    (median) and over the totals."""
    tokens, seconds = sum(r["tokens"] - 1 for r in runs), sum(r["decode_seconds"] for r in runs)
    base_tokens, base_seconds = sum(r["tokens"] - 1 for r in baseline), sum(r["decode_seconds"] for r in baseline)
    ratios = [r["tokens_per_second"] / b["tokens_per_second"] for r, b in zip(runs, baseline, strict=True)]
    return {
        "median_tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
        "decode_tokens": tokens,
        "decode_seconds": seconds,
        "median_ratio_to_llama_server": statistics.median(ratios),
        "total_ratio_to_llama_server": (tokens / seconds) / (base_tokens / base_seconds),
    }


# first_token ----------------------------------------------------------------------------------------------------


def quiet(spectune: httpx.Client) -> None:
    """Wait until spectune serve's slots are free (its work after an answer done): no engine is timed while the
    other works."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = spectune.get("/health").json()
        if health["slots_free"] == health["slots"]:
            return
        time.sleep(0.005)


def while_speaking(spectune: httpx.Client, opening: Messages, turn: dict[str, str], unsaid: int, user: str) -> dict:
    """A caller's first turn, then its second one's words sent as they come (a partial each 300 ms or more, at most
    8, the last lacking `unsaid` words), then the final request, timed."""
    answer = ask(spectune, opening, CALL_TOKENS, user=user)
    time.sleep(LISTEN_SECONDS)
    history = [*opening, {"role": "assistant", "content": answer["text"]}]
    words = turn["content"].split()
    heard = len(words) - unsaid
    for count in sorted({max(1, heard * step // 8) for step in range(1, 9)}):
        start = time.perf_counter()
        body = {"messages": [*history, {"role": "user", "content": " ".join(words[:count])}], "max_tokens": 0}
        spectune.post("/v1/chat/completions", json=body | {"user": user}).raise_for_status()
        time.sleep(max(0.0, PARTIAL_GAP_SECONDS - (time.perf_counter() - start)))
    return ask(spectune, [*history, turn], CALL_TOKENS, user=user)


def first_token_prompt(http: dict[str, httpx.Client], index: int, turns: tuple[str, str]) -> dict:
    """Every kind of turn for one dialogue (module docstring), engines in an order that turns with the index."""
    system = {"role": "system", "content": SYSTEM_PROMPT}
    first, second = ({"role": "user", "content": turn} for turn in turns)
    tag = f"{index}-{time.monotonic_ns()}"  # a caller new to both servers
    runs: dict[str, dict[str, Any]] = {}
    for engine in in_turn([SPECTUNE, LLAMA], index):
        quiet(http[SPECTUNE])
        new = ask(http[engine], [system, first], CALL_TOKENS, user=f"a-{tag}")
        time.sleep(LISTEN_SECONDS)
        quiet(http[SPECTUNE])
        history = [system, first, {"role": "assistant", "content": new["text"]}, second]
        runs[engine] = {"new": new, "returning": ask(http[engine], history, CALL_TOKENS, user=f"a-{tag}")}
    for kind, unsaid in (("while_speaking", 0), ("last_word_late", 1)):
        quiet(http[SPECTUNE])
        runs[SPECTUNE][kind] = while_speaking(http[SPECTUNE], [system, first], second, unsaid, f"{kind}-{tag}")
    if index % 5 == 0:
        quiet(http[SPECTUNE])
        salt = {"cache_salt": f"probe-{tag}", "user": f"c-{tag}"}
        runs[SPECTUNE]["other_tenant"] = ask(http[OTHER_TENANT], [system, first], CALL_TOKENS, **salt)
    print(f"first token {index + 1}: " + "  ".join(f"{e} {k} {r['ttft_ms']:.0f}" for e, kinds in runs.items()
                                                    for k, r in kinds.items()), flush=True)  # fmt: skip
    return runs


def first_token(http: dict[str, httpx.Client], dialogues: list[tuple[str, str]], args: Any) -> dict:
    def times(row: dict) -> dict[str, float]:
        return {f"{engine} {kind}": run["ttft_ms"] for engine, kinds in row.items() for kind, run in kinds.items()}

    for engine in (SPECTUNE, LLAMA):  # page faults, the first wake of each engine's threads
        ask(http[engine], [{"role": "user", "content": "Hello?"}], 4, user="warm-up")
    passes = [
        timed_passes(lambda i: first_token_prompt(http, i, dialogues[i]), len(dialogues), times)
        for _ in range(args.passes)
    ]
    every = [row for one in passes for row in one["rows"]]
    return {
        "n": len(dialogues),
        "passes": args.passes,
        "retimed": [one["retimed"] for one in passes],
        "still_stalled": [one["still_stalled"] for one in passes],
        "summary": ttft_summary(every),  # medians over every pass's prompts
        "summary_per_pass": [ttft_summary(one["rows"]) for one in passes],
        "prompts": [
            {e: {k: {f: v for f, v in r.items() if f != "text"} for k, r in kinds.items()} for e, kinds in row.items()}
            for row in every
        ],
    }


def ttft_summary(rows: list[dict]) -> dict[str, Any]:
    """Medians per engine and kind of turn (time to first token, the prefill each server reports), spectune's ratios
    to llama-server's (a turn llama-server has no kind for: its returning caller, the same final prompt), and the
    tokens another tenant reused."""

    def median_of(engine: str, kind: str, value: Callable[[dict], float]) -> float:
        return statistics.median(value(row[engine][kind]) for row in rows if kind in row[engine])

    out: dict[str, Any] = {}
    for engine in (SPECTUNE, LLAMA):
        out[engine] = {
            kind: {
                "median_ttft_ms": median_of(engine, kind, lambda run: run["ttft_ms"]),
                "median_prefill_ms": median_of(
                    engine, kind, lambda run: 1000 * run["stages"].get("prefill_seconds", 0)
                ),
                "n": sum(kind in row[engine] for row in rows),
            }
            for kind in rows[0][engine]
        }
    ours, theirs = out[SPECTUNE], out[LLAMA]
    for kind, figures in ours.items():
        if kind != "other_tenant":
            figures["ratio_to_llama_server"] = (
                figures["median_ttft_ms"] / theirs.get(kind, theirs["returning"])["median_ttft_ms"]
            )
    ours["other_tenant"]["cached_tokens"] = [row[SPECTUNE]["other_tenant"]["cached_tokens"] for row in rows
                                             if "other_tenant" in row[SPECTUNE]]  # fmt: skip
    return out


# load -----------------------------------------------------------------------------------------------------------


async def load_round(url: str, key: str | None, prompts: list[Messages], args: Any) -> list[dict[str, float]]:
    """--clients callers at once, --requests answers in all: each answer's time to first text, tokens and seconds."""
    queue, results = list(range(args.requests)), []
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def caller() -> None:
        # a connection per request, as serving_http.client (an engine may close an idle one as it is reused)
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers, limits=limits) as http:
            while queue:
                body = {"messages": prompts[queue.pop() % len(prompts)], "max_tokens": args.max_tokens, "stream": True}
                start, first, tokens = time.perf_counter(), None, 0
                try:
                    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                        if response.status_code != 200:
                            results.append({"error": str(response.status_code)})
                            continue
                        async for line in response.aiter_lines():
                            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                                "content"
                            ):
                                first, tokens = first or time.perf_counter() - start, tokens + 1
                except httpx.HTTPError as error:  # counted, as a caller would meet it
                    results.append({"error": type(error).__name__})
                    continue
                results.append({"ttft": first or 0.0, "tokens": tokens, "seconds": time.perf_counter() - start})

    await asyncio.gather(*(caller() for _ in range(args.clients)))
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load(urls: dict[str, str], prompts: list[Messages], args: Any) -> dict:
    """Each server in turn, round after round; each figure over every round's answers."""
    labels = [label for label in urls if label != OTHER_TENANT]
    answers: dict[str, list[dict]] = {label: [] for label in labels}
    for round_index in range(args.rounds):
        for label in in_turn(labels, round_index):
            answers[label] += asyncio.run(load_round(urls[label], key_of(label), prompts, args))
    out = {"clients": args.clients, "requests_per_round": args.requests, "rounds": args.rounds, "servers": {}}
    for label, results in answers.items():
        done = [r for r in results if "error" not in r]
        ttft = [1000 * r["ttft"] for r in done]
        out["servers"][label] = {
            "requests": len(results),
            "errors": len(results) - len(done),
            "error_kinds": sorted({r["error"] for r in results if "error" in r}),
            "p50_ttft_ms": percentile(ttft, 0.5),
            "p95_ttft_ms": percentile(ttft, 0.95),
            "median_stream_chunks_per_second": statistics.median(r["tokens"] / r["seconds"] for r in done),
        }
    return out


# audio ----------------------------------------------------------------------------------------------------------


def audio(url: str, calls: list[list[str]]) -> dict:
    """`spectune call --speak` per dialogue, its caller turns piped in: each turn's time to first words and audio."""
    turns = []
    for lines in calls:
        call = [str(Path(sys.executable).parent / "spectune"), "call", "--server", url, "--speak"]
        call += ["--system", SYSTEM_PROMPT, "--api-key", KEYS[0]]
        done = subprocess.run(call, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=600)
        found = [(int(words), int(sound)) for words, sound in TURN_LINE.findall(done.stdout)]
        if done.returncode != 0 or len(found) != len(lines):
            raise SystemExit(f"spectune call failed:\n{done.stdout}\n{done.stderr}")
        turns += [{"turn": i + 1, "first_words_ms": w, "first_audio_ms": a} for i, (w, a) in enumerate(found)]
        print("first audio " + " ".join(str(a) for _, a in found) + " ms", flush=True)
    return {
        "synthesizer": subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout.strip(),
        "median_first_audio_ms": statistics.median(turn["first_audio_ms"] for turn in turns),
        "median_first_words_ms": statistics.median(turn["first_words_ms"] for turn in turns),
        "turns": turns,
    }


# the run --------------------------------------------------------------------------------------------------------


def caller_turns(path: Path, count: int, least: int) -> list[list[str]]:
    """The caller turns of the first `count` dialogues with at least `least` of them (one line each)."""
    found = []
    for dialogue in read_dialogues(path, need_answer=False).dialogues:
        users = [m["content"].replace("\n", " ") for m in dialogue.messages if m["role"] == "user"]
        if len(users) >= least and len(users[1].split()) >= 4:
            found.append(users)
    return found[:count]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--draft-max", default="auto", help="k of the spectune servers (a run's pair.json has it)")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--name", required=True, help="the report is benchmarks/results/serving_NAME.json")
    parser.add_argument("--measure", nargs="+", choices=MEASURES, default=list(MEASURES))
    parser.add_argument("--n", type=int, default=30, help="prompts (decode) and dialogues (first_token)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ignore-eos", action="store_true", help="decode: every answer runs to --max-tokens")
    parser.add_argument("--passes", type=int, default=3, help="first_token: times over every dialogue")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16, help="load: answers per server and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=6, help="audio: dialogues (of 4 caller turns or more), every turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=1)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    dialogues = caller_turns(args.data, args.n, 2)
    prompts = [prompt.messages for prompt in read_prompts(args.data)[: args.n]]  # SGD turns with what came before
    model = LlamaModel(args.target, n_ctx=N_CTX, threads=args.threads, exact=True)
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/serving.py", *sys.argv[1:]]).replace(str(Path.home()), "~"),
        "target": shown(args.target),
        "draft": shown(args.draft) if args.draft else None,
        "data": shown(args.data),
        "threads": args.threads,
        "slots": args.slots,
        "max_tokens": args.max_tokens,
        "build": build_name(),
        "system_prompt_tokens": len(model.tokenize(SYSTEM_PROMPT, special=False)),
    }
    out = RESULTS / f"serving_{args.name}.json"
    with servers(args) as urls:
        http = clients_of(urls)
        report["modes"] = {label: http[label].get("/health").json().get("mode") for label in urls}
        measures = {
            "decode": lambda: decode(http, prompts, model, args),
            "first_token": lambda: first_token(http, [(d[0], d[1]) for d in dialogues], args),
            "load": lambda: load(urls, prompts, args),
            "audio": lambda: audio(urls[SPECTUNE], caller_turns(args.data, args.calls, 4)),
        }
        for name in args.measure:  # the report written after each: what was measured survives a later failure
            report[name] = measures[name]()
            with atomic_path(out) as tmp:
                tmp.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)
    print(f"wrote {out}")


def print_summary(report: dict[str, Any]) -> None:
    lines = [f"decode {label}: x{row['total_ratio_to_llama_server']:.3f} llama-server's tokens/s"
             for label, row in report.get("decode", {}).get("servers", {}).items()]  # fmt: skip
    ours = report.get("first_token", {}).get("summary", {}).get(SPECTUNE, {})
    lines += [f"first token, {kind}: {row['median_ttft_ms']:.0f} ms, x{row.get('ratio_to_llama_server', 0):.2f}"
              for kind, row in ours.items()]  # fmt: skip
    lines += [f"load {label}: p50 {row['p50_ttft_ms']:.0f} ms, {row['errors']} errors"
              for label, row in report.get("load", {}).get("servers", {}).items()]  # fmt: skip
    lines += [f"first audio: {report['audio']['median_first_audio_ms']:.0f} ms"] if "audio" in report else []
    print("\n".join(lines))


if __name__ == "__main__":
    main()
