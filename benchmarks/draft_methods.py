"""The comparison the project exists for: one row per draft (generic, sft, kd, seqkd, onpolicy) with the offline
acceptance α, τ at the best k, best k, the speedup that predicts on a memory-bound GPU, and the draft's training
time (teacher work included: seqkd's answers, kd's top-k cache). Runs a pipeline config, reusing its finished
stages, and writes benchmarks/results/draft_methods_<name>.json/.md.

Usage: python benchmarks/draft_methods.py configs/demo-medium.yaml --name medium
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spectune.pipeline import load_run_config, run_pipeline

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--name", required=True, help="suffix of the result files")
    args = parser.parse_args()
    config = load_run_config(args.config)
    run_pipeline(config)  # finished stages are reused from the run directory
    manifest = json.loads((config.run_dir / "manifest.json").read_text())
    acceptance = json.loads((config.run_dir / "acceptance.json").read_text())
    gpu = next(p["name"] for p in acceptance["profiles"] if p["name"].startswith("gpu"))
    rows = []
    for row in acceptance["drafts"]:
        k = row["best_k"][gpu]
        trained = manifest["stages"].get(f"draft:{row['name']}", {}).get("outputs", {})
        rows.append(
            {
                "name": row["name"],
                "alpha": row["alpha"],
                "tau": row["tau_simulated"][str(k)],
                "best_k": k,
                "predicted_speedup": row["speedup"][gpu][str(k)],
                "profile": gpu,
                "train_seconds": trained.get("seconds", 0.0) + trained.get("teacher_seconds", 0.0),
                "eval_loss": [trained.get("eval_loss_before"), trained.get("eval_loss_after")],
            }
        )
    pair, data = manifest["config"]["models"], manifest["config"]["data"]
    result = {"pair": pair, "data": data, "prompts": acceptance["prompts"], "threads": manifest["config"]["threads"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"draft_methods_{args.name}.json").write_text(json.dumps({**result, "rows": rows}, indent=2))
    lines = [
        f"# draft methods ({args.name})",
        "",
        f"pair: {pair}; data: {data}; {acceptance['prompts']} held-out prompts",
        "",
        "| draft | α | τ(k*) | k* | predicted GPU speedup | train s (teacher work included) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['name']} | {r['alpha']:.1%} | {r['tau']:.2f} | {r['best_k']} | {r['predicted_speedup']:.2f}x "
        f"| {r['train_seconds']:.0f} |"
        for r in rows
    ]
    (RESULTS / f"draft_methods_{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
