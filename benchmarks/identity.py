"""Identical answers per model, quantization, llama.cpp build and setting, with what each costs.

For every build (the installed one; others through LLAMA_CPP_LIB_PATH, e.g. the folder
`spectune tools build-llama-libs --llamafile` prints) and setting (exact on / off), a child process loads each target
GGUF with a draft that rejects (every step verifies k + 1 rows, the hard case), counts greedy answers equal to the
target alone at k = 3, and times one-token decoding, verification r(k+1) and a 128-token prefill. Builds and settings
run in turn within each round (interleaved); times are medians over rounds, identity counts come from the first.
Per build and pair it also counts the prompts whose answer from the target alone differs between the two settings:
the two "targets alone" of `spectune serve --mode speculative` (exact on) and `--mode fastest` (exact off).

Usage: python benchmarks/identity.py --name smollm2_sgd --data ../shared/data/sgd/dev.jsonl \
    --pair smollm2-Q4_K_M=TARGET.gguf,DRAFT.gguf \
    --lib llamafile-on=~/.cache/spectune/llama.cpp-lib/0.3.36+spectune.DIGEST-llamafile-on
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pipeline_run import RESULTS, write_result

from spectune.data.prepare import extract_prompts
from spectune.data.read import read_dialogues
from spectune.runtime.build import build_name, identity_verdict, matrix_types
from spectune.runtime.chat import chat_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DraftModel
from spectune.runtime.llama import LlamaModel
from spectune.runtime.profile import FILLER, measure_profile
from spectune.runtime.speculative import SpeculativeDecoder

DRAFT_MAX = 3
PREFILL = 128


def answers(target: LlamaModel, draft: LlamaModel, prompts: list, max_tokens: int) -> dict:
    """Identical answers (target alone vs with the draft) and the drafts' acceptance over the prompts."""
    plain, speculative = SpeculativeDecoder(target), SpeculativeDecoder(target, [DraftModel(draft, target)])
    config = DecodeSettings(max_tokens=max_tokens, draft_max=DRAFT_MAX)
    identical = drafted = accepted = 0
    alone_answers = []
    for messages in prompts:
        plain.forget()
        ids = chat_tokens(target, messages)
        alone = plain.generate(ids, config)
        with_draft = speculative.generate(ids, config)
        identical += alone.tokens == with_draft.tokens
        drafted, accepted = drafted + with_draft.stats.drafted, accepted + with_draft.stats.accepted
        alone_answers.append(alone.tokens)
    acceptance = accepted / drafted if drafted else 0.0
    return {"n": len(prompts), "identical": identical, "acceptance": acceptance, "alone_answers": alone_answers}


def prefill_seconds(target: LlamaModel) -> float:
    tokens = target.tokenize(FILLER * 40)[:PREFILL]
    times = []
    for _ in range(3):
        target.truncate(0)
        start = time.perf_counter()
        target.decode(tokens, 0, all_logits=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(spec: dict) -> dict:
    """One build (this process's libllama) and one setting, every pair."""
    prompts = [p.messages for p in extract_prompts(read_dialogues(spec["data"]).dialogues, spec["n"], seed=3)]
    results = {}
    for label, (target_path, draft_path) in spec["pairs"].items():
        target = LlamaModel(target_path, n_ctx=2048, threads=spec["threads"], exact=spec["exact"])
        draft = LlamaModel(draft_path, n_ctx=2048, threads=spec["threads"], exact=spec["exact"])
        row = answers(target, draft, prompts, spec["max_tokens"]) if spec["with_answers"] else {}
        row["prefill_seconds"] = prefill_seconds(target)
        target.close()
        draft.close()
        profile = measure_profile(target_path, draft_path, DRAFT_MAX + 1, 5, spec["threads"], spec["exact"])
        row["target_ms_per_token"] = profile["target_ms_per_token"]
        row["verify_ratio"] = profile["verify_ratio"][str(DRAFT_MAX + 1)]
        row["verdict"] = identity_verdict(target_path, spec["exact"])
        results[label] = row
    return {"build": build_name(), "results": results}


def run_child(spec: dict, lib: str | None) -> dict:
    env = {**os.environ, **({"LLAMA_CPP_LIB_PATH": lib} if lib else {})}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"child for {lib or 'the installed build'} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def modes_differ(collected: dict[str, dict[str, list]], libs: dict, pairs: dict) -> dict[str, dict[str, int]]:
    """Per build and pair: the prompts whose target-alone answer at exact on differs from exact off's."""
    differ: dict[str, dict[str, int]] = {}
    for lib_name in libs:
        for label in pairs:
            on, off = (collected[f"{lib_name}, exact {state}"][label][0]["alone_answers"] for state in ("on", "off"))
            differ.setdefault(lib_name, {})[label] = sum(a != b for a, b in zip(on, off, strict=True))
    return differ


def summarize(rounds: list[dict]) -> dict:
    one_token_ms = statistics.median(r["target_ms_per_token"] for r in rounds)
    return {
        **{key: rounds[0][key] for key in ("n", "identical", "acceptance", "verdict")},
        "target_ms_per_token": one_token_ms,
        "decode_tokens_per_second": 1000 / one_token_ms,
        f"verify_ratio_{DRAFT_MAX + 1}": statistics.median(r["verify_ratio"] for r in rounds),
        f"prefill_{PREFILL}_tokens_per_second": statistics.median(PREFILL / r["prefill_seconds"] for r in rounds),
        "rounds": len(rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="run")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/sgd/dev.jsonl"))
    parser.add_argument("--pair", action="append", default=[], help="LABEL=TARGET.gguf,DRAFT.gguf (repeatable)")
    parser.add_argument("--lib", action="append", default=[], help="NAME=DIR of another libllama build")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    pairs = {label: path.split(",") for label, path in (p.split("=", 1) for p in args.pair)}
    libs = {"installed": None} | {name: str(Path(d).expanduser()) for name, d in (x.split("=", 1) for x in args.lib)}
    spec = {"data": str(args.data), "n": args.prompts, "max_tokens": args.max_tokens, "threads": args.threads}
    spec["pairs"] = pairs
    collected: dict[str, dict[str, list]] = {}
    builds = {}
    for round_index in range(args.rounds):
        for lib_name, lib in libs.items():
            for exact in (True, False):
                run = run_child({**spec, "exact": exact, "with_answers": round_index == 0}, lib)
                key = f"{lib_name}, exact {'on' if exact else 'off'}"
                builds[key] = run["build"]
                for label, row in run["results"].items():
                    collected.setdefault(key, {}).setdefault(label, []).append(row)
                print(f"round {round_index + 1}: {key} ({run['build']}) done", flush=True)
    table = {key: {label: summarize(rows) for label, rows in by_pair.items()} for key, by_pair in collected.items()}
    report = {
        "builds": builds,
        "settings": {**spec, "draft_max": DRAFT_MAX, "rounds": args.rounds},
        "matrix_types": {label: dict(matrix_types(target)) for label, (target, _) in pairs.items()},
        "results": table,
        "modes_differ": modes_differ(collected, libs, pairs),
    }
    print(markdown(report))
    write_result(f"identity_{args.name}.json", report)
    (RESULTS / f"identity_{args.name}.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        f"Identical answers with a rejecting draft (k = {DRAFT_MAX}), {report['settings']['n']} prompts x "
        f"{report['settings']['max_tokens']} tokens, {report['settings']['threads']} threads; times are medians of "
        f"{report['settings']['rounds']} interleaved rounds.",
        "",
        "| build, setting | model | identical | acceptance | decode tok/s | r(k+1) | prefill tok/s | promised |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, by_pair in report["results"].items():
        for label, row in by_pair.items():
            promised = "yes" if row["verdict"]["guaranteed"] else "no"
            lines.append(
                f"| {key} | {label} | {row['identical']}/{row['n']} | {row['acceptance']:.1%} | "
                f"{row['decode_tokens_per_second']:.1f} | {row[f'verify_ratio_{DRAFT_MAX + 1}']:.2f} | "
                f"{row[f'prefill_{PREFILL}_tokens_per_second']:.0f} | {promised} |"
            )
    lines += ["", "The target alone at exact on vs exact off (`serve --mode speculative` vs `--mode fastest`):", ""]
    lines += ["| build | model | answers that differ |", "|---|---|---|"]
    for lib_name, by_pair in report.get("modes_differ", {}).items():
        n = report["settings"]["n"]
        lines += [f"| {lib_name} | {label} | {count}/{n} |" for label, count in by_pair.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
