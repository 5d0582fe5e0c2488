"""The comparison the project exists for: one row per draft (generic, sft, kd, seqkd, onpolicy) with the offline
acceptance α, τ at the best k, best k, the speedup that predicts on a memory-bound GPU, and the draft's training
time (teacher work included: seqkd's answers, kd's top-k cache). Runs a pipeline config, reusing its finished
stages, and writes benchmarks/results/draft_methods_<name>.json/.md.

Usage: python benchmarks/draft_methods.py configs/demo-medium.yaml --name medium
"""

from __future__ import annotations

import json

from pipeline_run import RESULTS, run_from_command_line

from spectune.speedup import GPU_PROFILE


def main() -> None:
    config, _, name = run_from_command_line(__doc__)
    manifest = json.loads(config.layout.manifest.read_text())
    acceptance = json.loads(config.layout.acceptance.read_text())
    rows = []
    for row in acceptance["drafts"]:
        k = row["recommended_k"]
        trained = manifest["stages"].get(f"draft:{row['name']}", {}).get("outputs", {})
        rows.append(
            {
                "name": row["name"],
                "alpha": row["alpha"],
                "tau": row["tau_simulated"][str(k)],
                "best_k": k,
                "predicted_speedup": row["speedup"][GPU_PROFILE][str(k)],
                "profile": GPU_PROFILE,
                "train_seconds": trained.get("seconds", 0.0) + trained.get("teacher_seconds", 0.0),
                "eval_loss": [trained.get("eval_loss_before"), trained.get("eval_loss_after")],
            }
        )
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
    (RESULTS / f"draft_methods_{name}.json").write_text(json.dumps({**result, "rows": rows}, indent=2))
    lines = [
        f"# draft methods ({name})",
        "",
        f"pair: {pair}; data: {data}; {acceptance['prompts']} held-out prompts",
        "",
        f"target eval loss {tuned['eval_loss_before']:.3f} -> {tuned['eval_loss_after']:.3f} after QLoRA "
        f"({tuned['seconds']:.0f} s)",
        "",
        "| draft | α | τ(k*) | k* | predicted GPU speedup | train s (teacher work included) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['name']} | {r['alpha']:.1%} | {r['tau']:.2f} | {r['best_k']} | {r['predicted_speedup']:.2f}x "
        f"| {r['train_seconds']:.0f} |"
        for r in rows
    ]
    (RESULTS / f"draft_methods_{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
