"""Our speculative loop against llama.cpp's own (`llama-speculative-simple`) at every k, on one pair: the same GGUFs,
prompts, threads and exact settings, interleaved prompt by prompt (`spectune bench --peer` at each k). Per k: our
tokens/s over llama.cpp's (pooled: all tokens over all decode seconds, the end token counted on both sides), the
acceptance each counts (pooled), identical answers, and our target alone over llama-server's (time per decode).
Goal (issue 17): ours at least 0.95 of llama.cpp's at every k.

Usage: python benchmarks/loop_vs_llama_cpp.py --run runs/demo --draft seqkd --ks 1 2 4 8 --name demo
       python benchmarks/loop_vs_llama_cpp.py --target T.gguf --draft eagle3=HEAD.gguf --data EVAL.jsonl --ks 1 --name X
(the second: GGUFs tuned outside a run, e.g. a head trained by `spectune eagle3`)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pipeline_run import write_result

from spectune.bench.config import BenchConfig
from spectune.bench.run import bench
from spectune.layout import TARGET, RunLayout

COLUMNS = (
    "vs_llama_cpp",
    "acceptance",
    "llama_cpp_acceptance",
    "acceptance_as_llama_cpp_counts",
    "identical",
    "llama_cpp_identical",
    "baseline_vs_llama_cpp",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a finished run directory")
    parser.add_argument("--draft", required=True, help="the draft's name in that run, or NAME=GGUF with --target")
    parser.add_argument("--target", type=Path, help="the target's GGUF, instead of a run's")
    parser.add_argument("--data", type=Path, help="the prompts (with --target)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", required=True, help="suffix of the result file")
    args = parser.parse_args()
    if args.target is not None:
        name, _, draft_gguf = args.draft.partition("=")
        target, drafts, data, source = args.target, {name: Path(draft_gguf)}, args.data, str(args.target)
    else:
        layout = RunLayout(args.run, "Q4_K_M")
        name, target, data, source = args.draft, layout.gguf(TARGET), layout.eval_file, str(args.run)
        drafts = {name: layout.gguf(name)}
    rows = []
    for k in args.ks:
        with tempfile.TemporaryDirectory() as out:
            config = BenchConfig(
                target=target,
                drafts=drafts,
                data=data,
                out=Path(out),
                n=args.n,
                repeats=args.repeats,
                max_tokens=args.max_tokens,
                draft_max=k,
                threads=args.threads,
                peer=True,
                plot=False,
            )
            summary = bench(config)["summary"][name]
        rows.append({"k": k} | {column: summary[column] for column in COLUMNS})
    print(
        "| k | ours / llama.cpp | acceptance ours / llama.cpp (ours counted as llama.cpp counts) | "
        "identical ours / llama.cpp | baseline |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['k']} | {row['vs_llama_cpp']:.2f}x | {row['acceptance']:.1%} / "
            f"{row['llama_cpp_acceptance']:.1%} ({row['acceptance_as_llama_cpp_counts']:.1%}) | "
            f"{row['identical']} / {row['llama_cpp_identical']} of {args.n} | {row['baseline_vs_llama_cpp']:.2f} |"
        )
    write_result(f"loop_vs_llama_cpp_{args.name}.json", {"run": source, "draft": args.draft, "rows": rows})


if __name__ == "__main__":
    main()
