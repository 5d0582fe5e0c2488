"""The comparison the project exists for: one row per draft (generic, sft, kd, seqkd, onpolicy, speckd) with the
offline acceptance α, α by draft position, τ at the best k, best k, the speedup that predicts on a memory-bound GPU,
and the draft's training time (teacher work included: seqkd's answers, kd's top-k cache), its own and with the
draft it started from. Runs a pipeline config, reusing its finished stages, and writes
benchmarks/results/draft_methods_<name>.json/.md.

With --control, each method that starts from another's draft (`drafts.start_from`, e.g. speckd from seqkd) is
also compared at equal wall-clock time: the draft it started from is trained on by its own method for as long as
the new method took (steps = the new method's seconds / the old one's seconds per step), and all of them are
measured again on the same held-out prompts, with speculative sampling's acceptance at temperature 1 beside the
greedy one. --tv adds each started method trained with divergence tv instead of its default.

Usage: python benchmarks/draft_methods.py configs/demo-medium.yaml --name medium
       python benchmarks/draft_methods.py configs/smollm2-sgd-speckd.yaml --name smollm2_sgd_speckd --control
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pipeline_run import RESULTS, command_line, run_from_command_line, write_result

from spectune.acceptance.stage import run_acceptance
from spectune.pipeline.config import RunConfig
from spectune.pipeline.stages import Context, acceptance_config, train_inputs
from spectune.speedup import GPU_PROFILE
from spectune.train.draft import DraftConfig, train_draft

POSITIONS = 4  # α by draft position shown in the table
SAMPLED_AT = 1.0  # --control also measures speculative sampling's acceptance at this temperature


def training_seconds(outputs: dict[str, Any]) -> float:
    return outputs.get("seconds", 0.0) + outputs.get("teacher_seconds", 0.0)


def draft_rows(acceptance: dict[str, Any], trained: dict[str, dict[str, Any]], start_from: dict[str, str]) -> list:
    """One row per measured draft; `trained` holds each trained draft's stage outputs by name."""
    rows = []
    for row in acceptance["drafts"]:
        k, name = row["recommended_k"], row["name"]
        outputs = trained.get(name, {})
        chain_seconds, method = training_seconds(outputs), name
        while method in start_from:  # a draft started from another's counts that one's time too
            method = start_from[method]
            chain_seconds += training_seconds(trained.get(method, {}))
        rows.append(
            {
                "name": name,
                "start_from": start_from.get(name),
                "alpha": row["alpha"],
                "alpha_by_position": row["alpha_by_position"],
                "alpha_sampled": row["alpha_sampled"],
                "tau": row["tau_simulated"][str(k)],
                "best_k": k,
                "predicted_speedup": row["speedup"][GPU_PROFILE][str(k)],
                "profile": GPU_PROFILE,
                "train_seconds": training_seconds(outputs),
                "train_seconds_total": chain_seconds,
                "eval_loss": [outputs.get("eval_loss_before"), outputs.get("eval_loss_after")],
            }
        )
    return rows


def finished_run(config: RunConfig, manifest: dict[str, Any]) -> Context:
    """What a stage of this finished run sees: the outputs of every stage."""
    outputs = {name: stage.get("outputs", {}) for name, stage in manifest["stages"].items()}
    return Context(config, config.layout, outputs)


def train_from(context: Context, method: str, start: str, **overrides: Any) -> dict:
    """A draft trained by `method` from the run's `start` draft, its settings with `overrides`."""
    name = "-".join([method, "from", start, *(f"{key}-{value}" for key, value in overrides.items())])
    out = context.config.run_dir / "drafts" / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh draft each time: no checkpoint of an older one resumes
    draft_config = DraftConfig(
        target=context.merged,
        draft=Path(context.outputs[f"draft:{start}"]["model"]),
        method=method,
        **train_inputs(context, out),
        **{**context.config.draft_settings(method), **overrides},
    )
    return {**train_draft(draft_config).model_dump(mode="json"), "start_from": start}


def equal_time_control(context: Context, method: str) -> dict[str, Any]:
    """The draft `method` started from, trained on by its own method for as long as `method` trained: steps from the
    started method's seconds per step, retrained once with the control's own pace when that missed by over 10%
    (the machine was busier or quieter when the started method trained)."""
    start = context.config.drafts.start_from[method]
    started, new = (context.outputs[f"draft:{m}"] for m in (start, method))
    budget = training_seconds(new)
    steps = max(1, round(budget / (started["seconds"] / started["steps"])))
    control = train_from(context, start, start, max_steps=steps)
    if abs(control["seconds"] - budget) > 0.1 * budget:
        steps = max(1, round(budget / (control["seconds"] / control["steps"])))
        control = train_from(context, start, start, max_steps=steps)
    return control


def table(name: str, result: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    tuned = result["target_eval_loss"]
    header_positions = " | ".join(f"α@{i}" for i in range(1, POSITIONS + 1))
    lines = [
        f"# draft methods ({name})",
        "",
        f"pair: {result['pair']}; data: {result['data']}; {result['prompts']} held-out prompts",
        "",
        f"target eval loss {tuned['before']:.3f} -> {tuned['after']:.3f} after QLoRA "
        f"({result['target_finetune_seconds']:.0f} s)",
        "",
        "α@i: acceptance at draft position i given the proposals before it accepted (k = 8 replayed). Train s: the "
        "method's own time, teacher work included; total: with the draft it started from.",
        "",
        f"| draft | from | α | {header_positions} | α sampled (T = {SAMPLED_AT:g}) | τ(k*) | k* "
        "| predicted GPU speedup | train s | total s |",
        "|---|---|---|" + "---|" * POSITIONS + "---|---|---|---|---|---|",
    ]
    for r in rows:
        positions = " | ".join(
            f"{r['alpha_by_position'][str(i)]:.1%}" if str(i) in r["alpha_by_position"] else "-"
            for i in range(1, POSITIONS + 1)
        )
        sampled = "-" if r["alpha_sampled"] is None else f"{r['alpha_sampled']:.1%}"
        lines.append(
            f"| {r['name']} | {r['start_from'] or '-'} | {r['alpha']:.1%} | {positions} | {sampled} | {r['tau']:.2f} "
            f"| {r['best_k']} | {r['predicted_speedup']:.2f}x | {r['train_seconds']:.0f} "
            f"| {r['train_seconds_total']:.0f} |"
        )
    return lines


def main() -> None:
    args = command_line(
        __doc__,
        {
            "--control": "also train and measure the equal-time controls",
            "--tv": "with --control, also each started method with divergence tv (speculative sampling's acceptance)",
        },
    )
    config, _, name = run_from_command_line(__doc__, args)
    manifest = json.loads(config.layout.manifest.read_text())
    acceptance = json.loads(config.layout.acceptance.read_text())
    trained = {m: manifest["stages"][f"draft:{m}"]["outputs"] for m in config.drafts.methods}
    start_from = dict(config.drafts.start_from)
    if args.control:  # every row measured again in one meter run, the controls beside them
        context = finished_run(config, manifest)
        drafts = context.drafts()
        for method, start in config.drafts.start_from.items():
            extra = {f"{start} continued": equal_time_control(context, method)}
            if args.tv:
                extra[f"{method} (tv)"] = train_from(context, method, start, divergence="tv")
            for extra_name, outputs in extra.items():
                trained[extra_name], start_from[extra_name] = outputs, start
                drafts[extra_name] = Path(outputs["model"])
        acceptance = run_acceptance(acceptance_config(context, drafts, temperature=SAMPLED_AT))
    pair, data = manifest["config"]["models"], manifest["config"]["data"]
    tuned = manifest["stages"]["finetune"]["outputs"]
    result = {
        "pair": pair,
        "data": data,
        "prompts": acceptance["prompts"],
        "threads": manifest["config"]["threads"],
        "target_eval_loss": {"before": tuned["eval_loss_before"], "after": tuned["eval_loss_after"]},
        "target_finetune_seconds": tuned["seconds"],
    }
    rows = draft_rows(acceptance, trained, start_from)
    write_result(f"draft_methods_{name}.json", {**result, "rows": rows})
    lines = table(name, result, rows)
    (RESULTS / f"draft_methods_{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
