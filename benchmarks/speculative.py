"""Speculative decoding on llama.cpp, per draft: identical answers (and the setting used), mean/best/worst
wall-clock speedup on this machine, acceptance, τ, the measured c and r(k+1), the predicted GPU speedup and, with
`bench.peer: true`, our tokens/s over llama.cpp's own llama-speculative-simple on the same pair and settings.
Runs a pipeline config, reusing its finished stages, and writes benchmarks/results/speculative_<name>.json/.md.

Usage: python benchmarks/speculative.py configs/demo-medium.yaml --name medium
"""

from __future__ import annotations

import json
import platform

from pipeline_run import RESULTS, run_from_command_line

from spectune.bench.run import SUMMARY_KEYS


def main() -> None:
    config, summary, name = run_from_command_line(__doc__)
    layout = config.layout
    manifest = json.loads(layout.manifest.read_text())
    drafts = {}
    for draft, s in summary["bench"].items():
        drafts[draft] = {key: s[key] for key in SUMMARY_KEYS}
        drafts[draft]["vs_llama_cpp"] = s.get("vs_llama_cpp")  # None: the peer was not run
        drafts[draft]["llama_cpp_identical"] = s.get("llama_cpp_identical")
    result = {
        "pair": manifest["config"]["models"],
        "data": manifest["config"]["data"],
        "machine": f"{platform.machine()}, {manifest['config']['threads'] or 'all'} threads",
        "drafts": drafts,
    }
    (RESULTS / f"speculative_{name}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"speculative_{name}.md").write_text((layout.bench_dir / "report.md").read_text())
    print(summary["line"])


if __name__ == "__main__":
    main()
