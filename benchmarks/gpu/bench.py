"""The GPU half of benchmarks/gpu/run.sh: the shipped pair through spectune's bench (target alone vs each draft,
interleaved, medians, identical-answer check) with llama.cpp's own llama-speculative-simple beside it, each draft
at its best k from the acceptance stage. Writes OUT/report.json/.md and OUT/speculative_gpu.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spectune.bench.config import BenchConfig
from spectune.bench.run import bench
from spectune.bench.summary import result_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pair", type=Path, required=True, help="folder with target.*.gguf, drafts, prompts")
    parser.add_argument("--peer", type=Path, help="llama-speculative-simple built for this machine")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    target = next(args.pair.glob("target.*.gguf"))
    drafts = {path.name.split(".")[0]: path for path in sorted(args.pair.glob("*.gguf")) if path != target}
    acceptance = json.loads((args.pair / "acceptance.json").read_text())
    recommended_k = {row["name"]: row["recommended_k"] for row in acceptance["drafts"]}
    try:
        import matplotlib  # noqa: F401

        plot = True
    except ImportError:
        print("matplotlib is not installed here: no PNG plots (the JSON and Markdown reports are complete)")
        plot = False
    report = bench(
        BenchConfig(
            target=target,
            drafts=drafts,
            data=args.pair / "prompts.jsonl",
            out=args.out,
            n=args.n,
            repeats=args.repeats,
            recommended_k=recommended_k,
            peer=args.peer is not None,
            peer_binary=args.peer,
            plot=plot,
        )
    )
    result = {name: result_row(s) for name, s in report["summary"].items()}
    (args.out / "speculative_gpu.json").write_text(json.dumps({"target": target.name, "drafts": result}, indent=2))
    print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
