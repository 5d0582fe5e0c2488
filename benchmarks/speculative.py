"""Speculative decoding on llama.cpp, per draft: identical answers (and the setting used), the aggregate wall-clock
speedup on this machine (all tokens over all decode time) with the totals it rests on, mean/best/worst per-prompt
speedups, TTFT and time to first sentence, acceptance, τ, the measured c and r(k+1), the predicted GPU speedup and,
with `bench.peer: true` (or --peer), llama.cpp's own figures beside ours: its llama-speculative-simple on the same
pair and its target alone (our baseline over llama.cpp's, and each draft's speedup over llama.cpp's target alone).
Runs a pipeline config, reusing its finished stages, and writes benchmarks/results/speculative_<name>.json/.md.

Usage: python benchmarks/speculative.py configs/demo-medium.yaml --name medium
       python benchmarks/speculative.py demo:demo --name demo --peer   (what `spectune demo` runs, llama.cpp beside)
       python benchmarks/speculative.py demo:demo --name demo --peer --ngram   (and n-gram lookup variants)
       python benchmarks/speculative.py configs/smollm2-sgd.yaml --name smollm2_sgd_ngram --peer --ngram \
           --methods-seqkd --one-repeat   (a real pair, trimmed to the off-the-shelf and seqkd drafts)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline_run import LEAN_SWITCHES, RESULTS, command_line, lean_overrides, run_from_command_line, write_result

from spectune.bench.summary import result_row


def main() -> None:
    switches = {
        "--peer": "set bench.peer (needs `spectune tools build-llama-cpp`)",
        "--ngram": "set drafts.ngram: n-gram lookup variants (the domain table from seqkd's target answers)",
        **LEAN_SWITCHES,
    }
    args = command_line(__doc__, switches)
    # this bench compares draft models; a head's bench is benchmarks/eagle3.py (llama.cpp's loop) or the run's own
    overrides: dict[str, dict[str, Any]] = {"drafts": {"eagle3": None}}
    if args.peer:
        overrides["bench"] = {"peer": True}
    if args.ngram:
        overrides["drafts"]["ngram"] = {}
    config, summary, name = run_from_command_line(__doc__, args, lean_overrides(args, overrides), rerun_from="bench")
    layout = config.layout
    manifest = json.loads(layout.manifest.read_text())
    drafts = {draft: result_row(s) for draft, s in summary["bench"].items()}
    bench = json.loads((layout.bench_dir / "report.json").read_text())
    profile = next(iter(bench["summary"].values()))["profile"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True).stdout.strip()
    result = {
        # What a skeptic needs to redo it: the command, the code, the machine, and every prompt's figures.
        "command": "python benchmarks/" + " ".join(Path(arg).name if i == 0 else arg for i, arg in enumerate(sys.argv)),
        "commit": commit + (" with uncommitted changes to src/" if changed else ""),
        "pair": manifest["config"]["models"],
        "data": manifest["config"]["data"],
        "machine": f"{profile['machine']}, {bench['settings']['threads']} threads",
        "timed_runs": bench["settings"]["repeats"],  # interleaved timed runs per prompt (medians)
        "retimed": bench["retimed"],  # prompts timed again after a stall (bench/stalls.py)
        "serving": bench["serving"],  # the mode `spectune serve --mode auto` would choose here (bench/serving.py)
        "drafts": drafts,
        "prompts": bench["prompts"],
    }
    write_result(f"speculative_{name}.json", result)
    (RESULTS / f"speculative_{name}.md").write_text((layout.bench_dir / "report.md").read_text())
    print(summary["line"])


if __name__ == "__main__":
    main()
