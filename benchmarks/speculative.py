"""Speculative decoding on llama.cpp, per draft: identical answers (and the setting used), mean/best/worst
wall-clock speedup on this machine, acceptance, τ, the measured c and r(k+1), the predicted GPU speedup and, with
`bench.peer: true`, our tokens/s over llama.cpp's own llama-speculative-simple on the same pair and settings.
Runs a pipeline config, reusing its finished stages, and writes benchmarks/results/speculative_<name>.json/.md.

Usage: python benchmarks/speculative.py configs/demo-medium.yaml --name medium
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from spectune.bench.run import SUMMARY_KEYS
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
    drafts = {}
    for name, s in summary["bench"].items():
        drafts[name] = {key: s[key] for key in SUMMARY_KEYS}
        drafts[name]["vs_llama_cpp"] = s.get("vs_llama_cpp")  # None: the peer was not run
        drafts[name]["llama_cpp_identical"] = s.get("llama_cpp_identical")
    result = {
        "pair": manifest["config"]["models"],
        "data": manifest["config"]["data"],
        "machine": f"{platform.machine()}, {manifest['config']['threads'] or 'all'} threads",
        "drafts": drafts,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"speculative_{args.name}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"speculative_{args.name}.md").write_text((config.run_dir / "bench" / "report.md").read_text())
    print(summary["line"])


if __name__ == "__main__":
    main()
