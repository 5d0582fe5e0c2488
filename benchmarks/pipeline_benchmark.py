"""Run a spectune pipeline config (or reuse its finished run) and write the two comparison results:

- benchmarks/results/draft_methods_<name>.json/.md: one row per draft (generic, sft, kd, onpolicy) with the
  offline acceptance α, τ at the best k, best k, the predicted speedup (memory-bound GPU profile) and the
  draft's training time;
- benchmarks/results/speculative_<name>.json/.md: per draft, the llama.cpp bench: identical answers, the
  setting used (exact), mean/best/worst wall-clock speedup here, acceptance, τ, c, r(k+1), predicted GPU speedup.

Usage: python benchmarks/pipeline_benchmark.py configs/demo-small.yaml --name demo_small
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
    summary = run_pipeline(config)  # finished stages are reused from the run directory
    manifest = json.loads((config.run_dir / "manifest.json").read_text())
    acceptance = json.loads((config.run_dir / "acceptance.json").read_text())
    gpu = next(p["name"] for p in acceptance["profiles"] if p["name"].startswith("gpu"))
    pair = f"{manifest['config']['models']}"
    data = manifest["config"]["data"]
    rows = []
    for row in acceptance["drafts"]:
        k = row["best_k"][gpu]
        stage = manifest["stages"].get(f"draft:{row['name']}")
        rows.append(
            {
                "name": row["name"],
                "alpha": row["alpha"],
                "tau": row["tau_simulated"][str(k)],
                "best_k": k,
                "predicted_speedup": row["speedup"][gpu][str(k)],
                "profile": gpu,
                "train_seconds": stage["outputs"]["seconds"] if stage else 0.0,
            }
        )
    methods = {"pair": pair, "data": data, "prompts": acceptance["prompts"], "rows": rows}
    bench = {"pair": pair, "data": data, "drafts": {}}
    for name, s in summary["bench"].items():
        bench["drafts"][name] = {
            key: s[key]
            for key in (
                "n",
                "identical",
                "exact",
                "mean_speedup",
                "best_speedup",
                "worst_speedup",
                "acceptance",
                "mean_accepted_len",
                "cost_ratio",
                "verify_ratio",
                "predicted_speedup_gpu",
                "gpu_cost_ratio",
            )
        }
        bench["drafts"][name]["vs_llama_cpp"] = None  # the llama.cpp peer run is not built yet
    bench["threads"] = manifest["config"]["threads"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"draft_methods_{args.name}.json").write_text(json.dumps(methods, indent=2))
    (RESULTS / f"speculative_{args.name}.json").write_text(json.dumps(bench, indent=2))
    lines = [
        f"# draft methods ({args.name})",
        "",
        f"pair: {pair}; data: {data}",
        "",
        "| draft | α | τ(k*) | k* | predicted GPU speedup | train s |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['name']} | {r['alpha']:.1%} | {r['tau']:.2f} | {r['best_k']} | {r['predicted_speedup']:.2f}x "
        f"| {r['train_seconds']:.0f} |"
        for r in rows
    ]
    (RESULTS / f"draft_methods_{args.name}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"speculative_{args.name}.md").write_text((config.run_dir / "bench" / "report.md").read_text())
    print("\n".join(lines))
    print(summary["line"])


if __name__ == "__main__":
    main()
