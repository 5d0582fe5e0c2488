"""When a voice bot's caller hears the first word: time to first token through HTTP, spectune serve against
llama-server at its defaults on the same GGUF, threads and context, every call behind one operator system prompt of
a few hundred tokens (the same for every caller, as a bot's persona and policies are).

Per SGD dialogue with two caller turns, engines taking turns (the first one turns with the prompt):
- **new caller**: the system prompt and the caller's first turn (llama-server reuses whatever its slot or its host
  prompt cache shares; spectune the tenant's shared system prompt);
- **returning caller**: the same caller's second turn, its first answer (each engine's own) in the history, sent
  half a second after that answer (the caller hears it first);
- before each timed request, spectune serve's slots are free (its work after an answer done): no engine is timed
  while the other works;
- **while speaking** (spectune only): another caller's same two turns, the second one's words sent as they come
  (max_tokens 0, a partial transcript each 300 ms or more, at most 8, the last one all the words, as a recognizer's
  is when it ends the turn), then the final request: time from that request; compared with llama-server's
  returning caller, the same final prompt; **last word late**: the same, the last partial lacking the last word;
- **another tenant** (spectune only, every fifth prompt): the first turn under the second API key and a fresh
  cache_salt, after the first tenant cached the same system prompt: its cached_tokens must be 0, its time that of a
  cold prefill.

Three passes over the prompts (--passes); in each, a prompt where any engine's time to first token was over 3x its
median for that kind of turn is timed again, once. Medians are over every pass's prompts, and per pass.
Decode speed per answer is the tokens of its text after the first over the time from first text to last.

Usage: python benchmarks/first_token.py --target T.gguf --data dev.jsonl --name NAME [--n 30] [--max-tokens 24]
       [--passes 3]
Writes benchmarks/results/first_token_NAME.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
from never_slower import RESULTS, shown, streamed

from spectune.data.read import read_dialogues
from spectune.engines.llama_server import LlamaServer, free_port
from spectune.runtime.build import build_name
from spectune.runtime.llama import LlamaModel
from spectune.serve.config import ServeConfig
from spectune.serve.engine import READY_SECONDS, start_llama_server

KEYS = ("sk-bench-tenant-one", "sk-bench-tenant-two")
# Between an answer and the caller's next turn: the caller hears the answer (spoken, it lasts seconds) and speaks.
LISTEN_SECONDS = 0.5
SPECTUNE, LLAMA = "spectune serve", "llama-server, defaults"
PARTIAL_GAP_SECONDS = 0.3
SYSTEM_PROMPT = (
    "You are Ava, the phone assistant of Northwind Concierge, a booking service for restaurants, travel, events, "
    "banking appointments and home services. Callers reach you by phone, so everything you say is read aloud by a "
    "speech engine. Speak in short, plain sentences of at most two clauses; never use lists, markdown, emoji or "
    "abbreviations that a voice cannot read; spell out times as people say them, such as half past seven. Always "
    "answer the caller's last request first, then ask for the one detail you still need, one question at a time. "
    "Before you book, buy, transfer or cancel anything, repeat the key details (date, time, place, number of "
    "people, amount) and ask the caller to confirm with a yes. Never invent availability, prices, addresses or "
    "phone numbers: when you do not know, say you will check and offer to send the details by text message. Do "
    "not ask for full card numbers, passwords or security codes; for payments, tell the caller that a secure link "
    "will be sent. If a caller sounds upset, apologise once, briefly, and move on to solving the problem. If a "
    "caller asks for a human, say that you will transfer the call and stop. Keep the caller's name if they give it "
    "and use it at most once per answer. Our opening hours are eight in the morning to ten at night, every day, "
    "and our policies allow free cancellation up to twenty-four hours before a booking. Today's date is Monday, "
    "the seventh of December."
)


def two_turn_dialogues(path: Path, count: int) -> list[tuple[str, str]]:
    """The first two caller turns of the first `count` dialogues that have two."""
    turns = []
    for dialogue in read_dialogues(path, need_answer=False).dialogues:
        users = [m["content"] for m in dialogue.messages if m["role"] == "user"]
        if len(users) >= 2 and len(users[1].split()) >= 4:
            turns.append((users[0], users[1]))
    return turns[:count]


def ask(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """One streamed greedy answer: its text, time to first text, decode span, the reported usage and stages."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    body["stream_options"] = {"include_usage": True}
    answer = streamed(client, body)
    first, last, start = answer["first"], answer["last"], answer["start"]
    return {
        "text": answer["text"],
        "ttft_ms": 1000 * ((first or start) - start),
        "decode_seconds": (last - first) if first and last else 0.0,
        "prompt_tokens": answer["usage"].get("prompt_tokens"),
        "cached_tokens": (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
        "stages": stages(answer["reported"]),
    }


def quiet(server: httpx.Client) -> None:
    """Wait until spectune serve's slots are free, its work after an answer (the next turn's opening, keeping the
    conversation) done: no engine is timed while the other works."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = server.get("/health").json()
        if health["slots_free"] == health["slots"]:
            return
        time.sleep(0.005)


def stages(reported: dict[str, Any]) -> dict[str, float]:
    """The server's seconds per stage before the first token: spectune's stages, llama-server's prompt time."""
    if "prompt_ms" in reported:
        return {"prefill_seconds": reported["prompt_ms"] / 1000}
    return reported.get("stages", {})


def prefill(client: httpx.Client, messages: list[dict[str, str]], user: str) -> float:
    start = time.perf_counter()
    body = {"messages": messages, "max_tokens": 0, "user": user}
    client.post("/v1/chat/completions", json=body).raise_for_status()
    return time.perf_counter() - start


def while_speaking(
    ours: httpx.Client, opening: list[dict[str, str]], turn: dict[str, str], unsaid: int, user: str, args: Any
) -> dict[str, Any]:
    """A caller's first turn, then its second one's words sent as they come (a partial transcript each 300 ms or
    more, at most 8, the last lacking `unsaid` words), then the final request, timed."""
    answer = ask(ours, opening, args.max_tokens, user=user)
    time.sleep(LISTEN_SECONDS)
    history = [*opening, {"role": "assistant", "content": answer["text"]}]
    words = turn["content"].split()
    heard = len(words) - unsaid
    for count in sorted({max(1, heard * step // 8) for step in range(1, 9)}):
        spent = prefill(ours, [*history, {"role": "user", "content": " ".join(words[:count])}], user)
        time.sleep(max(0.0, PARTIAL_GAP_SECONDS - spent))
    return ask(ours, [*history, turn], args.max_tokens, user=user)


@contextmanager
def engines(args: argparse.Namespace) -> Iterator[dict[str, httpx.Client]]:
    """spectune serve as a user starts it (with two tenants' keys) and llama-server at its defaults, each its own
    process, up together."""
    with ExitStack() as stack:
        port = free_port()
        command = [str(Path(sys.executable).parent / "spectune"), "serve", "--target", str(args.target)]
        command += ["--n-ctx", "4096", "--threads", str(args.threads), "--port", str(port), "--api-key", ",".join(KEYS)]
        log = stack.enter_context(tempfile.TemporaryFile("w+"))
        ours = stack.enter_context(LlamaServer(command, {}, f"http://127.0.0.1:{port}", log))
        ours.wait_ready(READY_SECONDS)
        llama = ServeConfig(
            target=args.target, n_ctx=4096, threads=args.threads, engine="llama.cpp", port=free_port(), exact=False,
            draft_max=0,
        )  # fmt: skip
        theirs = stack.enter_context(start_llama_server(llama, stack.enter_context(tempfile.TemporaryFile("w+"))))
        yield {
            SPECTUNE: stack.enter_context(client(ours.url, KEYS[0])),
            LLAMA: stack.enter_context(client(theirs.url)),
            "other tenant": stack.enter_context(client(ours.url, KEYS[1])),
        }


def client(url: str, key: str | None = None) -> httpx.Client:
    """A connection per request, as each engine closes idle ones on its own clock (a reused one it had just closed
    failed the request); on loopback a connection costs well under a millisecond."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, timeout=600, headers=headers, limits=httpx.Limits(max_keepalive_connections=0))


def one_prompt(clients: dict[str, httpx.Client], index: int, turns: tuple[str, str], args: argparse.Namespace) -> dict:
    """Every kind of turn for one dialogue (module docstring), engines in an order that turns with the index."""
    system = {"role": "system", "content": SYSTEM_PROMPT}
    first, second = ({"role": "user", "content": turn} for turn in turns)
    tag = f"{index}-{time.monotonic_ns()}"  # a caller new to both servers
    runs: dict[str, dict[str, Any]] = {}
    for engine in [SPECTUNE, LLAMA][index % 2 :] + [SPECTUNE, LLAMA][: index % 2]:
        quiet(clients[SPECTUNE])
        new = ask(clients[engine], [system, first], args.max_tokens, user=f"a-{tag}")
        time.sleep(LISTEN_SECONDS)
        quiet(clients[SPECTUNE])
        history = [system, first, {"role": "assistant", "content": new["text"]}, second]
        runs[engine] = {"new": new, "returning": ask(clients[engine], history, args.max_tokens, user=f"a-{tag}")}
    for kind, unsaid in (("while_speaking", 0), ("last_word_late", 1)):
        quiet(clients[SPECTUNE])
        runs[SPECTUNE][kind] = while_speaking(clients[SPECTUNE], [system, first], second, unsaid, f"{kind}-{tag}", args)
    if index % 5 == 0:
        quiet(clients[SPECTUNE])
        salt = {"cache_salt": f"probe-{tag}", "user": f"c-{tag}"}
        runs[SPECTUNE]["other_tenant"] = ask(clients["other tenant"], [system, first], args.max_tokens, **salt)
    line = "  ".join(f"{e} {kind} {run['ttft_ms']:.0f}" for e, kinds in runs.items() for kind, run in kinds.items())
    print(f"prompt {index + 1}: {line} ms", flush=True)
    return runs


def stalled(runs: list[dict]) -> list[int]:
    """Prompts where an engine's time to first token was over 3x its median for that kind of turn."""
    slow = set()
    for engine in (SPECTUNE, LLAMA):
        for kind in runs[0][engine]:
            times = [run[engine][kind]["ttft_ms"] for run in runs if kind in run[engine]]
            median = statistics.median(times)
            slow |= {
                i for i, run in enumerate(runs) if kind in run[engine] and run[engine][kind]["ttft_ms"] > 3 * median
            }
    return sorted(slow)


def summary(runs: list[dict]) -> dict[str, Any]:
    """Medians per engine and kind of turn, the ratios to llama-server's, and the decode speed ratio."""

    def ttfts(engine: str, kind: str) -> list[float]:
        return [run[engine][kind]["ttft_ms"] for run in runs if kind in run[engine]]

    def rate(answer: dict) -> float | None:
        return None if answer["decode_seconds"] <= 0 else (len(answer["text"]) / answer["decode_seconds"])

    out: dict[str, Any] = {}

    def prefill_ms(engine: str, kind: str) -> float | None:
        times = [1000 * run[engine][kind]["stages"].get("prefill_seconds", 0.0) for run in runs if kind in run[engine]]
        return statistics.median(times) if all(times) else None

    for engine in (SPECTUNE, LLAMA):
        out[engine] = {
            kind: {
                "median_ttft_ms": statistics.median(ttfts(engine, kind)),
                "median_prefill_ms": prefill_ms(engine, kind),  # as the server reports it
                "n": len(ttfts(engine, kind)),
            }
            for kind in runs[0][engine]
        }
    base_new, base_back = ttfts(LLAMA, "new"), ttfts(LLAMA, "returning")
    ours = out[SPECTUNE]
    ours["new"]["ratio_to_llama_server"] = ours["new"]["median_ttft_ms"] / statistics.median(base_new)
    ours["returning"]["ratio_to_llama_server"] = ours["returning"]["median_ttft_ms"] / statistics.median(base_back)
    for kind in ("while_speaking", "last_word_late"):
        ours[kind]["ratio_to_llama_server_returning"] = ours[kind]["median_ttft_ms"] / statistics.median(base_back)
    probes = [run[SPECTUNE]["other_tenant"] for run in runs if "other_tenant" in run[SPECTUNE]]
    ours["other_tenant"]["cached_tokens"] = [probe["cached_tokens"] for probe in probes]
    ratios = []
    for run in runs:
        for kind in ("new", "returning"):
            mine, theirs = rate(run[SPECTUNE][kind]), rate(run[LLAMA][kind])
            if mine and theirs and len(run[SPECTUNE][kind]["text"]) > 20:
                ratios.append(mine / theirs)
    out["decode_speed_ratio_median"] = statistics.median(ratios) if ratios else None
    out["same_answers"] = sum(run[SPECTUNE]["new"]["text"] == run[LLAMA]["new"]["text"] for run in runs)
    return out


def target_and_data() -> argparse.ArgumentParser:
    """The options every serving bench here takes: the GGUF, the dialogues, the result's name, the threads."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def main() -> None:
    parser = target_and_data()
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--passes", type=int, default=3, help="times over every prompt, each stall-checked")
    args = parser.parse_args()
    dialogues = two_turn_dialogues(args.data, args.n)
    tokenizer = LlamaModel(args.target, n_ctx=256, threads=1)
    system_tokens = len(tokenizer.tokenize(SYSTEM_PROMPT, special=False))
    passes = []
    with engines(args) as clients:
        warm = [{"role": "user", "content": "Hello?"}]
        for engine in (SPECTUNE, LLAMA):  # page faults, the first wake of each engine's threads
            ask(clients[engine], warm, 4, user="warm-up")
        for _ in range(args.passes):
            runs = [one_prompt(clients, i, turns, args) for i, turns in enumerate(dialogues)]
            retimed = stalled(runs)
            for i in retimed:
                runs[i] = one_prompt(clients, i, dialogues[i], args)
            passes.append({"runs": runs, "retimed": [i + 1 for i in retimed], "still_stalled": stalled(runs)})
    every = [run for one in passes for run in one["runs"]]
    report = {
        "target": shown(args.target),
        "data": shown(args.data),
        "n": len(dialogues),
        "passes": args.passes,  # over the prompts each, every kind of turn timed once a pass
        "system_prompt_tokens": system_tokens,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "build": build_name(),
        "command": " ".join(["python", "benchmarks/first_token.py", *sys.argv[1:]]).replace(str(Path.home()), "~"),
        "retimed": [one["retimed"] for one in passes],
        "still_stalled": [[i + 1 for i in one["still_stalled"]] for one in passes],
        "summary": summary(every),  # medians over every pass's prompts
        "summary_per_pass": [summary(one["runs"]) for one in passes],
        "prompts": [
            {e: {k: {f: v for f, v in r.items() if f != "text"} for k, r in kinds.items()} for e, kinds in run.items()}
            for run in every
        ],
    }
    out = RESULTS / f"first_token_{args.name}.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
