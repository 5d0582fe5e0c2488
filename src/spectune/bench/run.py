"""`spectune bench`: the target alone beside the target with each draft, prompt by prompt, interleaved.

For every prompt the runs alternate (target, draft A, draft B, target, ...) after a warm-up, `repeats` times, and
medians are kept, so a change in machine load hits every variant alike. Greedy answers are compared with the
target alone's. The hardware profile (c, r(n)) is measured in the same run, and the speedup the measured τ
predicts is given for this machine and for a memory-bound GPU (r = 1), beside the measured wall-clock one.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from spectune.atomic import atomic_path
from spectune.runtime.chat import chat_prompt
from spectune.runtime.llama import LlamaModel
from spectune.runtime.profile import measure_profile
from spectune.runtime.speculative import SamplingConfig, SpeculativeDecoder, Stats
from spectune.speedup import speedup, verify_ratio_at

console = Console()


@dataclass
class BenchConfig:
    target: Path
    drafts: dict[str, Path]
    data: Path
    out: Path
    n: int = 30
    repeats: int = 3
    max_tokens: int = 64
    draft_max: int = 8
    draft_p_min: float = 0.0
    adaptive: bool = False
    exact: bool = True
    threads: int | None = None
    n_ctx: int = 2048
    gpu_cost_ratio: dict[str, float] | None = None  # per draft; default: GGUF size ratio (memory-bound decoding)


def bench(config: BenchConfig) -> dict[str, Any]:
    from spectune.data.prepare import read_prompts

    prompts = read_prompts(config.data)[: config.n]
    target = LlamaModel(config.target, n_ctx=config.n_ctx, threads=config.threads, exact=config.exact)
    decoders = {"target": SpeculativeDecoder(target)}
    for name, path in config.drafts.items():
        draft = LlamaModel(path, n_ctx=config.n_ctx, threads=config.threads, exact=config.exact)
        decoders[name] = SpeculativeDecoder(target, draft)
    sampling = SamplingConfig(
        max_tokens=config.max_tokens,
        draft_max=config.draft_max,
        draft_p_min=config.draft_p_min,
        adaptive=config.adaptive,
    )
    rows = []
    for index, prompt in enumerate(prompts):
        ids = target.tokenize(chat_prompt(target, prompt.messages))
        runs: dict[str, list[tuple[list[int], Stats]]] = {name: [] for name in decoders}
        for decoder in decoders.values():  # warm-up: caches, page faults
            decoder.generate(ids, sampling)
        for _ in range(config.repeats):
            for name, decoder in decoders.items():
                runs[name].append(decoder.generate(ids, sampling))
        plain_tokens = runs["target"][0][0]
        row: dict[str, Any] = {
            "prompt": index,
            "prompt_tokens": len(ids),
            "answer": target.detokenize(plain_tokens),
            "variants": {},
        }
        for name, results in runs.items():
            stats = [s for _, s in results]
            tps = statistics.median(s.tokens_per_second for s in stats)
            row["variants"][name] = {
                "tokens": stats[0].generated,
                "tokens_per_second": tps,
                "ttft_ms": 1000 * statistics.median(s.ttft_seconds for s in stats),
                "acceptance": stats[0].acceptance_rate,
                "mean_accepted_len": stats[0].mean_accepted_len,
                "drafted_at": stats[0].drafted_at,
                "accepted_at": stats[0].accepted_at,
                "draft_seconds": statistics.median(s.draft_seconds for s in stats),
                "verify_seconds": statistics.median(s.verify_seconds for s in stats),
                "identical": all(tokens == plain_tokens for tokens, _ in results),
            }
        base = row["variants"]["target"]["tokens_per_second"]
        for variant in row["variants"].values():
            variant["speedup"] = variant["tokens_per_second"] / base if base else 0.0
        rows.append(row)
        console.print(
            f"prompt {index + 1}/{len(prompts)}: "
            + "  ".join(
                f"{name} {v['tokens_per_second']:.0f} tok/s ({v['speedup']:.2f}x)"
                for name, v in row["variants"].items()
            )
        )
    profiles = {
        name: measure_profile(
            config.target, path, max_batch=config.draft_max + 1, threads=config.threads, exact=config.exact
        )
        for name, path in config.drafts.items()
    }
    report = {
        "target": str(config.target),
        "drafts": {name: str(path) for name, path in config.drafts.items()},
        "data": str(config.data),
        "settings": {
            "n": len(prompts),
            "repeats": config.repeats,
            "max_tokens": config.max_tokens,
            "draft_max": config.draft_max,
            "draft_p_min": config.draft_p_min,
            "adaptive": config.adaptive,
            "exact": config.exact,
            "threads": target.threads,
            "greedy": True,
        },
        "prompts": rows,
        "summary": {name: _summary(name, rows, profiles[name], config, path) for name, path in config.drafts.items()},
    }
    write_report(report, config.out)
    return report


def _summary(name: str, rows: list[dict], profile: dict, config: BenchConfig, draft_path: Path) -> dict[str, Any]:
    variants = [row["variants"][name] for row in rows]
    speedups = [v["speedup"] for v in variants]
    drafted = sum(sum(v["drafted_at"]) for v in variants)
    accepted = sum(sum(v["accepted_at"]) for v in variants)
    tau = statistics.mean(v["mean_accepted_len"] for v in variants)
    k = config.draft_max
    cost_ratio = profile["cost_ratio"]
    gpu_c = (config.gpu_cost_ratio or {}).get(name) or draft_path.stat().st_size / config.target.stat().st_size
    positions = max((len(v["drafted_at"]) for v in variants), default=0)
    per_position = []
    for position in range(positions):
        d = sum(v["drafted_at"][position] for v in variants if position < len(v["drafted_at"]))
        a = sum(v["accepted_at"][position] for v in variants if position < len(v["accepted_at"]))
        per_position.append(a / d if d else 0.0)
    return {
        "n": len(rows),
        "identical": sum(v["identical"] for v in variants),
        "exact": config.exact,
        "mean_speedup": statistics.mean(speedups),
        "best_speedup": max(speedups),
        "worst_speedup": min(speedups),
        "acceptance": accepted / drafted if drafted else 0.0,
        "acceptance_by_position": per_position,
        "mean_accepted_len": tau,
        "cost_ratio": cost_ratio,
        "verify_ratio": verify_ratio_at(profile["verify_ratio"], k + 1),
        "profile": profile,
        "predicted_speedup_here": speedup(tau, k, cost_ratio, verify_ratio_at(profile["verify_ratio"], k + 1)),
        "gpu_cost_ratio": gpu_c,
        "predicted_speedup_gpu": speedup(tau, k, gpu_c, 1.0),
    }


def write_report(report: dict[str, Any], out: Path) -> None:
    """report.json, report.md and two PNG plots, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "report.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2))
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(markdown(report))
    plot(report, out)


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        "# spectune bench",
        "",
        f"Target `{report['target']}`, {settings['n']} prompts from `{report['data']}`, greedy, "
        f"{settings['max_tokens']} tokens max, k = {settings['draft_max']}, exact = {settings['exact']}, "
        f"{settings['threads']} threads, medians of {settings['repeats']} interleaved runs.",
        "",
        "| draft | identical | acceptance | τ (tokens/verify) | speedup here mean / best / worst | c | r(k+1) "
        "| predicted here | predicted GPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["summary"].items():
        lines.append(
            f"| {name} | {s['identical']}/{s['n']} | {s['acceptance']:.1%} | {s['mean_accepted_len']:.2f} | "
            f"{s['mean_speedup']:.2f}x / {s['best_speedup']:.2f}x / {s['worst_speedup']:.2f}x | "
            f"{s['cost_ratio']:.3f} | {s['verify_ratio']:.2f} | {s['predicted_speedup_here']:.2f}x | "
            f"{s['predicted_speedup_gpu']:.2f}x (c = {s['gpu_cost_ratio']:.3f}) |"
        )
    lines += [
        "",
        "Predicted GPU speedup: τ / (1 + k·c), decoding memory-bound (r = 1), c from the GGUF size ratio. "
        "On a small CPU verification is compute-bound (r(k+1) well above 1), so the wall-clock speedup here "
        "stays near or below 1 whatever the acceptance.",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name in report["summary"]:
        speedups = [row["variants"][name]["speedup"] for row in report["prompts"]]
        axes[0].plot(range(1, len(speedups) + 1), speedups, marker="o", label=name)
        by_position = report["summary"][name]["acceptance_by_position"]
        axes[1].plot(range(1, len(by_position) + 1), by_position, marker="o", label=name)
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set(title="wall-clock speedup per prompt (this machine)", xlabel="prompt", ylabel="speedup")
    axes[1].set(title="acceptance by draft position", xlabel="position", ylabel="accepted", ylim=(0, 1.05))
    for axis in axes:
        axis.legend()
    figure.tight_layout()
    with atomic_path(out / "report.png") as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    plt.close(figure)
