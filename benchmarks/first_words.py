"""When a caller hears the first words: time to first token and to first sentence (the first clause a TTS engine can
speak) through the HTTP servers, as a voice bot sees them, on the same pair, prompts and threads: spectune's server
with the target alone and with the draft (each `--first-words` mode), and llama.cpp's llama-server alone and with the
draft. Each prompt is a new caller's first turn (nothing cached), then that caller's second turn (its first turn
cached by both servers). Variants take turns prompt by prompt (interleaved); figures are medians over the prompts.

Then what the first token's own step costs in throughput: spectune's loop on the same prompts with the first token
drafted (as llama-speculative-simple does, the draft reading the prompt before it) and with the first token the
target's own (spectune's loop), interleaved prompt by prompt: all tokens over all decode seconds, both identical to
the target alone.

Usage: python benchmarks/first_words.py --run runs/demo --data FILE --name demo [--n 30]
Writes benchmarks/results/first_words_NAME.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from serve_load import RESULTS, serving

from spectune.data.prepare import read_prompts
from spectune.layout import RunLayout
from spectune.runtime.build import build_name
from spectune.runtime.chat import CLAUSE_END, chat_tokens
from spectune.runtime.chosen import ChosenPair
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DraftModel
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder

VARIANTS = {  # name: (engine, with the draft, spectune's --first-words)
    "spectune, target alone": ("spectune", False, None),
    "spectune, draft from token 2": ("spectune", True, "draft"),
    "spectune, first clause alone": ("spectune", True, "alone"),
    "spectune, auto": ("spectune", True, "auto"),
    "llama-server, target alone": ("llama.cpp", False, None),
    "llama-server, with draft": ("llama.cpp", True, None),
}


def first_words(client: httpx.Client, messages: list[dict], max_tokens: int, user: str) -> tuple[float, float, str]:
    """(TTFT s, time to first sentence s, the answer) of one streamed turn, timed by the caller."""
    start, first, sentence, text = time.perf_counter(), 0.0, 0.0, ""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0, "user": user}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if piece:
                first = first or time.perf_counter() - start
                text += piece
                if not sentence and CLAUSE_END.search(text):
                    sentence = time.perf_counter() - start
    end = time.perf_counter() - start
    return first or end, sentence or end, text


def call(client: httpx.Client, messages: list[dict], max_tokens: int, user: str) -> dict[str, Any]:
    """A new caller's first turn, then their second: both timed."""
    ttft, ttfs, answer = first_words(client, messages, max_tokens, user)
    follow_up = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Yes, please."}]
    next_ttft, next_ttfs, _ = first_words(client, follow_up, max_tokens, user)
    return {"ttft": ttft, "ttfs": ttfs, "next_ttft": next_ttft, "next_ttfs": next_ttfs, "answer": answer}


class FirstTokenDrafted(SpeculativeDecoder):
    """spectune's loop as it was, and as llama-speculative-simple runs: the first step drafts too."""

    def _step(self, sequence: list[int], produced: int, k: int, config: DecodeSettings, sampler, draft: bool):
        return super()._step(sequence, produced, k, config, sampler, True)


def first_token_cost(target: Path, draft: Path, k: int, prompts: list, threads: int | None) -> dict[str, Any]:
    """Aggregate decode speed and answers of the two loops on the prompts (one warm-up, then one timed run each)."""
    target_model = LlamaModel(target, n_ctx=2048, threads=threads)
    draft_model = LlamaModel(draft, n_ctx=2048, threads=threads)
    loops = {
        "target alone": SpeculativeDecoder(target_model),
        "first token drafted": FirstTokenDrafted(target_model, draft_model),
        "first token alone": SpeculativeDecoder(target_model, [DraftModel(draft_model, target_model)]),
    }
    totals = {name: {"tokens": 0, "decode_seconds": 0.0, "steps": 0, "identical": 0} for name in loops}
    for prompt in prompts:
        ids = chat_tokens(target_model, prompt.messages)
        alone = None
        for name, loop in loops.items():
            config = DecodeSettings(max_tokens=48, draft_max=0 if name == "target alone" else k)
            loop.generate(ids, config)  # warm-up: both caches hold the prompt, as in the bench
            generation = loop.generate(ids, config)
            alone = alone or generation.tokens
            stats = generation.stats
            totals[name]["tokens"] += stats.generated
            totals[name]["decode_seconds"] += stats.total_seconds - stats.prefill_seconds
            totals[name]["steps"] += stats.verify_steps
            totals[name]["identical"] += generation.tokens == alone
    base = totals["target alone"]["decode_seconds"]
    for figures in totals.values():
        figures["aggregate_speedup"] = base / figures["decode_seconds"]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="A finished run folder: its chosen pair and k.")
    parser.add_argument("--data", type=Path, required=True, help="Prompts: a chat dataset.")
    parser.add_argument("--name", required=True, help="Suffix of the results file.")
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--loop-n", type=int, default=200, help="Prompts for the throughput comparison.")
    args = parser.parse_args()
    chosen = ChosenPair.read(RunLayout(args.run).chosen_pair)
    target, draft = chosen.target, chosen.draft
    prompts = read_prompts(args.data)[: args.n]
    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with contextlib.ExitStack() as stack:  # every server up at once, idle but for the one being asked
        clients = {}
        for name, (engine, drafted, mode) in VARIANTS.items():
            own = {"draft_max": chosen.k} | ({"first_words": mode} if mode else {})
            settings = argparse.Namespace(slots=1, threads=args.threads)
            url = stack.enter_context(serving(engine, target, draft if drafted else None, settings, **own))
            # A new connection per request, for every variant: llama-server closes a connection after some streamed
            # answers, and a request sent on it as it closes fails ("Server disconnected").
            limits = httpx.Limits(max_keepalive_connections=0)
            clients[name] = stack.enter_context(httpx.Client(base_url=url, timeout=300, limits=limits))
            call(clients[name], prompts[0].messages, args.max_tokens, "warm-up")  # page faults, first allocations
        for index, prompt in enumerate(prompts):  # interleaved: every variant on a prompt, then the next prompt
            for name, client in clients.items():
                rows[name].append(call(client, prompt.messages, args.max_tokens, f"caller-{index}"))
    for name, variant in rows.items():
        print(name, summarize(variant))
    cost = first_token_cost(target, draft, chosen.k, read_prompts(args.data)[: args.loop_n], args.threads)
    alone = [row["answer"] for row in rows["spectune, target alone"]]
    report = {
        "target": str(target.name),
        "draft": f"{chosen.draft_name} ({draft.name}), k = {chosen.k}",
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "machine": f"{platform.machine()}, {args.threads or 'all'} threads",
        "build": build_name(),
        "variants": {
            name: summarize(variant) | {"identical": sum(r["answer"] == a for r, a in zip(variant, alone, strict=True))}
            for name, variant in rows.items()
        },
        "first_token_cost": cost,
        "per_prompt": rows,
    }
    out = RESULTS / f"first_words_{args.name}.json"
    out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {out}")


def summarize(rows: list[dict]) -> dict[str, float]:
    return {
        f"{key}_ms": 1000 * statistics.median(row[key] for row in rows)
        for key in ("ttft", "ttfs", "next_ttft", "next_ttfs")
    }


def print_table(report: dict) -> None:
    print(f"{report['prompts']} prompts, {report['draft']}, medians in ms, through HTTP")
    print(
        "| variant | TTFT, new caller | first sentence, new caller | TTFT, next turn | first sentence, next turn "
        "| same answer |"
    )
    print("|---|---|---|---|---|---|")
    for name, v in report["variants"].items():
        print(
            f"| {name} | {v['ttft_ms']:.0f} | {v['ttfs_ms']:.0f} | {v['next_ttft_ms']:.0f} | {v['next_ttfs_ms']:.0f} "
            f"| {v['identical']}/{report['prompts']} |"
        )
    print("| loop | tokens | decode s | target passes | aggregate speedup | identical |")
    print("|---|---|---|---|---|---|")
    for name, c in report["first_token_cost"].items():
        print(
            f"| {name} | {c['tokens']} | {c['decode_seconds']:.2f} | {c['steps']} | {c['aggregate_speedup']:.2f}x "
            f"| {c['identical']} |"
        )


if __name__ == "__main__":
    main()
