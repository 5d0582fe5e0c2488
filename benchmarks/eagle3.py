"""The run's EAGLE-3 head beside its best standalone draft (by predicted GPU speedup), or, in a run with
`drafts.assistant`, the retuned Gemma 4 MTP assistant beside the assistant as shipped (both at k = 3, the published
draft-mtp runs' draft length), decoded by llama.cpp's own loop (llama-speculative-simple: `--spec-type` as each GGUF
is, `draft-eagle3`, `draft-mtp` or `draft-simple`), against
llama.cpp's target alone (llama-server, the same GGUF, threads and exact settings): identical answers, acceptance as
llama.cpp counts it, wall-clock speed over the target alone (all tokens over all decode seconds, each prompt's
median run), beside the acceptance stage's offline α, τ at the recommended k, c (what a step reads of the GGUFs)
and predicted GPU speedup, and the head's training time (spectune's own loop runs a head too). Runs the config's
stages up to acceptance (finished ones reused), with `drafts.eagle3: {}` where the config has none; prompts, their
count, repeats and answer length are the config's bench settings.

Usage: python benchmarks/eagle3.py configs/smollm2-sgd.yaml --name smollm2_sgd --methods-seqkd
       python benchmarks/eagle3.py demo:demo --name demo
       python benchmarks/eagle3.py demo:gemma4-demo --name gemma4_demo_assistant
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline_run import LEAN_SWITCHES, command_line, config_from_command_line, lean_overrides, write_result

from spectune.bench.llama_cpp_loop import llama_baseline, run_peer
from spectune.bench.run import rounds, without_bos
from spectune.data.prepare import read_prompts
from spectune.engines.llama_cpp import SPECULATIVE_TOOL, built_tool
from spectune.gpu.card import GROUNDED_PROFILE
from spectune.layout import CONTROL_DRAFT, TARGET
from spectune.pipeline.run import Run
from spectune.pipeline.stages import Context, stages
from spectune.runtime.chat import chat_prompt
from spectune.runtime.llama import LlamaModel
from spectune.runtime.registry import Variant
from spectune.speedup import GPU_PROFILE
from spectune.threads import thread_count
from spectune.train.assistant import ASSISTANT
from spectune.train.eagle3 import EAGLE3

N_CTX = 4096
MTP_DRAFT_MAX = 3  # the published draft-mtp runs' (Gemma 4 12B with its assistant, the llama.cpp PR's comment)


def predicted_gpu(row: dict[str, Any]) -> float:
    """The acceptance stage's predicted GPU speedup of a draft at its recommended k."""
    return row["speedup"][GPU_PROFILE][str(row["recommended_k"])]


def run_until_acceptance(run: Run) -> dict[str, dict[str, Any]]:
    """The run's stages up to and with acceptance (finished ones reused); their outputs."""
    table = stages(run.config)
    last = [stage.name for stage in table].index("acceptance")
    for number, stage in enumerate(table[: last + 1], 1):
        run.execute(stage, number, len(table))
    return run.outputs


def same_answer(text: str | None, answer: str, cut: bool) -> bool:
    """The tool's text is the target alone's; where the target stopped at the token limit (`cut`), its text
    continued: llama-speculative-simple decodes past -n when its last verify step accepts beyond it."""
    return text == answer or (cut and text is not None and text.startswith(answer))


def prompt_row(index: int, runs: dict[str, list], baseline: str, max_tokens: int) -> dict[str, Any]:
    """One prompt: per variant its median decode figures and whether every run's text is the target alone's."""
    row: dict[str, Any] = {"prompt": index, "answer": runs[baseline][0].text, "variants": {}}
    cut = runs[baseline][0].decoded_tokens >= max_tokens
    for name, results in runs.items():
        row["variants"][name] = {
            "tokens": results[0].decoded_tokens,
            "seconds": statistics.median(r.seconds for r in results),
            "drafted": results[0].drafted,
            "accepted": results[0].accepted,
            "identical": all(same_answer(r.text, row["answer"], cut) for r in results),
            "text": results[0].text if results[0].text != row["answer"] else "(the answer)",
        }
    return row


def counted_tokens(row: dict[str, Any], name: str) -> int:
    """A variant's tokens on one prompt, by the target alone's own count where its answer is the target alone's:
    llama-speculative-simple counts one token more than llama-server for the same answer on 90 of 200 prompts."""
    variant = row["variants"][name]
    return row["variants"][TARGET]["tokens"] if variant.get("identical", True) else variant["tokens"]


def prompt_acceptance(variants: list[dict[str, Any]]) -> list[float]:
    return [v["accepted"] / v["drafted"] for v in variants if v.get("drafted")]


def summary(rows: list[dict[str, Any]], name: str, baseline_seconds: float, accepted: dict[str, Any]) -> dict:
    variants = [row["variants"][name] for row in rows]
    tokens, seconds = sum(counted_tokens(row, name) for row in rows), sum(v["seconds"] for v in variants)
    drafted = sum(v["drafted"] for v in variants)
    base_tokens = sum(row["variants"][TARGET]["tokens"] for row in rows)
    result = {
        "n": len(rows),
        "tokens": tokens,
        "decode_seconds": round(seconds, 3),
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "over_llama_cpp_target_alone": (tokens / seconds) / (base_tokens / baseline_seconds) if seconds else 0.0,
        "identical": sum(v["identical"] for v in variants),
        "llama_cpp_acceptance": sum(v["accepted"] for v in variants) / drafted if drafted else 0.0,
        # per prompt that drafted: what one caller sees (a long answer weighs as much as a short one)
        "median_prompt_acceptance": statistics.median(per_prompt)
        if (per_prompt := prompt_acceptance(variants))
        else 0.0,
    }
    if name in accepted:
        row, k = accepted[name], str(accepted[name]["recommended_k"])
        result |= {
            "k": row["recommended_k"],
            "alpha": row["alpha"],
            "tau": row["tau_simulated"][k],
            "cost_ratio_gpu_bytes": row["cost_ratio"][GPU_PROFILE],
            "predicted_gpu": predicted_gpu(row),
            "cost_ratio_grounded": row["cost_ratio"][GROUNDED_PROFILE],
            "predicted_gpu_grounded": row["speedup"][GROUNDED_PROFILE][k],
        }
    return result


def bench_pair(
    target_gguf: Path, drafts: dict[str, tuple[Path, int]], prompts: list, repeats: int, max_tokens: int, threads: int
) -> list[dict[str, Any]]:
    """Every prompt through llama.cpp's target alone and each draft (name: a Variant's, its GGUF and k; where the
    Variant's draft is `eagle3` the GGUF runs as a head, its lookups in front of it), interleaved, after a warm-up
    round."""
    binary = built_tool(SPECULATIVE_TOOL)
    target = LlamaModel(target_gguf, n_ctx=N_CTX, threads=threads)
    rows = []
    with llama_baseline(target_gguf, threads, N_CTX, exact=True) as alone:
        for index, prompt in enumerate(prompts):
            text = without_bos(target, chat_prompt(target, prompt.messages))
            runs = {TARGET: lambda text=text: alone(text, max_tokens)}
            for name, (gguf, k) in drafts.items():
                variant = Variant.parse(name)
                runs[name] = lambda gguf=gguf, k=k, variant=variant, text=text: run_peer(
                    *(binary, target_gguf, gguf, text, k, max_tokens, threads, N_CTX),
                    exact=True,
                    lookups=variant.lookups,
                )
            rows.append(prompt_row(index, rounds(runs, repeats), TARGET, max_tokens))
            line = "  ".join(f"{n} {v['tokens']}/{v['seconds']:.3f}s" for n, v in rows[-1]["variants"].items())
            print(f"prompt {index + 1}: {line}", flush=True)
    return rows


def result_report(rows: list[dict[str, Any]], drafts: list[str], accepted: dict[str, Any], **about: Any) -> dict:
    """The bench's result file: how it was made (`about`), the summaries and the per-prompt rows."""
    baseline_seconds = sum(row["variants"][TARGET]["seconds"] for row in rows)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True).stdout.strip()
    return {
        "command": "python benchmarks/" + " ".join(Path(arg).name if i == 0 else arg for i, arg in enumerate(sys.argv)),
        "commit": commit + (" with uncommitted changes to src/" if changed else ""),
        **about,
        "target_alone": summary(rows, TARGET, baseline_seconds, accepted),
        "drafts": {name: summary(rows, name, baseline_seconds, accepted) for name in drafts},
        "prompts": rows,
    }


def compared(config: Any, run: Run, outputs: dict[str, Any]) -> tuple[dict[str, tuple[Path, int]], dict[str, Any]]:
    """The drafts to decode (GGUF and k) and the head's training figures: the retuned assistant beside the one as
    shipped, else the EAGLE-3 head beside the best standalone draft."""
    layout, accepted = config.layout, {row["name"]: row for row in outputs["acceptance"]["drafts"]}
    if config.drafts.assistant is not None:
        drafts = {name: (layout.gguf(name), MTP_DRAFT_MAX) for name in (CONTROL_DRAFT, ASSISTANT)}
        return drafts, {"assistant_training": {key: outputs[ASSISTANT][key] for key in ("steps", "seconds")}}
    standalone = [name for name in Context(config, run.layout, outputs).drafts() if name not in (CONTROL_DRAFT, EAGLE3)]
    best = max(standalone, key=lambda name: predicted_gpu(accepted[name]))
    head = outputs[EAGLE3]
    training = {key: head[key] for key in ("steps", "seconds", "feature_seconds", "parameters")}
    training |= {"aux_layers": head["aux_layers"], "draft_vocab_size": head["draft_vocab_size"]}
    return {name: (layout.gguf(name), accepted[name]["recommended_k"]) for name in (best, EAGLE3)}, {
        "eagle3_training": training
    }


def main() -> None:
    args = command_line(__doc__, LEAN_SWITCHES)
    config = config_from_command_line(args.config)
    heads = config.drafts.eagle3 is not None or config.drafts.assistant is not None
    overrides: dict[str, dict[str, Any]] = {} if heads else {"drafts": {"eagle3": {}}}
    config = config_from_command_line(args.config, lean_overrides(args, overrides))
    run = Run(config)
    outputs = run_until_acceptance(run)
    accepted = {row["name"]: row for row in outputs["acceptance"]["drafts"]}
    drafts, training = compared(config, run, outputs)
    layout, bench, threads = config.layout, config.bench, thread_count(config.threads)
    prompts = read_prompts(layout.eval_file)[: bench.n]
    rows = bench_pair(layout.gguf(TARGET), drafts, prompts, bench.repeats, bench.max_tokens, threads)
    result = result_report(
        rows,
        list(drafts),
        accepted,
        pair=run.manifest["config"]["models"],
        machine=f"{run.manifest['machine']}, {threads} threads",
        settings={"n": len(rows), "repeats": bench.repeats, "max_tokens": bench.max_tokens},
        **training,
    )
    for name, (_, k) in drafts.items():  # the k llama.cpp drafted with (the acceptance rows' is their own best k)
        result["drafts"][name]["k_decoded"] = k
    write_result(f"eagle3_{args.name}.json", result)
    print(json.dumps({"target_alone": result["target_alone"], "drafts": result["drafts"]}, indent=2))


if __name__ == "__main__":
    main()
