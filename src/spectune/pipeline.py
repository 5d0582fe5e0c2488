"""`spectune run CONFIG.yaml`: the stage graph, the run directory and its manifest.

data -> models -> finetune (QLoRA) -> merge -> draft:<method>... -> acceptance -> export -> bench -> report.
Each stage calls the same entry function its CLI verb does. A stage whose inputs (its config section, the
stages it reads, the data) did not change since it last finished is skipped, so a crashed or interrupted run
resumes at the first unfinished stage; an interrupted fine-tune continues from its last checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.console import Console

from spectune.atomic import atomic_path
from spectune.errors import SpectuneError

console = Console()
Method = Literal["sft", "kd", "seqkd", "onpolicy"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelsSection(Section):
    size: Literal["micro", "small", "medium"] | None = "small"  # a demo-world pair ...
    target: Path | None = None  # ... or your own local HF folders
    draft: Path | None = None
    models_dir: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelsSection:
        if (self.target is None) != (self.draft is None):
            raise ValueError("give both target and draft, or neither (then size picks a demo pair)")
        if self.target is not None:
            self.size = None
        return self


class DataSection(Section):
    path: Path | Literal["demo"] = "demo"
    demo_dialogues: int = Field(2000, ge=100, le=50_000)
    eval_data: Path | None = None
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    system: str | None = None
    seed: int = 0


class FinetuneSection(Section):
    four_bit: bool = True
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    epochs: float = Field(1.0, gt=0)
    max_steps: int = 0
    batch_size: int = Field(8, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(2e-4, gt=0)
    max_tokens: int = Field(512, ge=16)
    max_eval: int = Field(100, ge=1)
    save_steps: int = Field(50, ge=1)


class DraftSection(Section):
    methods: list[Method] = ["sft", "kd"]
    divergence: Literal["forward_kl", "reverse_kl", "jsd", "tv"] = "forward_kl"
    temperature: float = Field(1.0, gt=0)
    epochs: float = Field(1.0, gt=0)
    max_steps: int = 0
    batch_size: int = Field(8, ge=1)
    lr: float = Field(1e-3, gt=0)
    max_tokens: int = Field(512, ge=16)
    max_eval: int = Field(100, ge=1)
    max_train: int = Field(0, ge=0)
    max_new_tokens: int = Field(64, ge=1)
    teacher_top_k: int = Field(0, ge=0)
    overrides: dict[Method, dict[str, Any]] = {}  # per method, e.g. seqkd: {max_train: 300}

    @model_validator(mode="after")
    def _known_overrides(self) -> DraftSection:
        allowed = set(type(self).model_fields) - {"methods", "overrides"}
        for method, values in self.overrides.items():
            unknown = set(values) - allowed
            if unknown:
                raise ValueError(f"overrides.{method}: unknown setting(s) {', '.join(sorted(unknown))}")
        return self

    def for_method(self, method: str) -> dict[str, Any]:
        """This section's settings for one method, its overrides applied (validated again by DraftConfig)."""
        return {**self.model_dump(mode="json", exclude={"methods", "overrides"}), **self.overrides.get(method, {})}


class AcceptanceSection(Section):
    n: int = Field(30, ge=1)
    max_new_tokens: int = Field(64, ge=1)


class ExportSection(Section):
    quant: str = "Q4_K_M"
    fidelity_dialogues: int = Field(20, ge=0)


class BenchSection(Section):
    n: int = Field(30, ge=1)
    repeats: int = Field(3, ge=1)
    max_tokens: int = Field(64, ge=1)
    draft_max: int | Literal["auto"] = "auto"  # auto: each draft's best k for a GPU, from the acceptance stage
    draft_p_min: float = Field(0.0, ge=0, le=1)
    exact: bool = True
    peer: bool = False  # also run llama.cpp's own speculative decoder (needs `spectune tools build-llama-cpp`)


class RunConfig(Section):
    run_dir: Path = Path("runs/demo")
    threads: int | None = None
    data: DataSection = DataSection()
    models: ModelsSection = ModelsSection()
    finetune: FinetuneSection = FinetuneSection()
    drafts: DraftSection = DraftSection()
    acceptance: AcceptanceSection = AcceptanceSection()
    export: ExportSection = ExportSection()
    bench: BenchSection = BenchSection()


def check_paths(config: RunConfig, source: str) -> None:
    """Missing input paths, all reported at once with their YAML path."""
    from spectune.errors import Problem

    problems = []
    for where, path in (
        ("data.path", config.data.path),
        ("data.eval_data", config.data.eval_data),
        ("models.target", config.models.target),
        ("models.draft", config.models.draft),
    ):
        if isinstance(path, Path) and not path.exists():
            problems.append(Problem(source, f"no such file or folder: {path}", field=where))
    if problems:
        raise SpectuneError(f"{source}: {len(problems)} config error(s)", problems)


def load_run_config(path: Path) -> RunConfig:
    from spectune.config import read_yaml, validate

    config = validate(RunConfig, read_yaml(path), str(path))
    check_paths(config, str(path))
    return config


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


class Run:
    """A run directory with its manifest; `stage` runs a step unless its inputs are unchanged."""

    def __init__(self, config: RunConfig, force_from: str | None = None, only: str | None = None) -> None:
        self.config = config
        self.dir = config.run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest_path = self.dir / "manifest.json"
        self.manifest: dict[str, Any] = (
            json.loads(self.manifest_path.read_text()) if self.manifest_path.is_file() else {"stages": {}}
        )
        self.manifest["config"] = config.model_dump(mode="json")
        self.manifest["versions"] = {
            name: version(name)
            for name in ("spectune", "torch", "transformers", "trl", "peft", "bitsandbytes", "llama-cpp-python")
        }
        self.manifest["machine"] = platform.platform()
        self.force_from, self.only = force_from, only
        self.forcing = False
        self.order: list[str] = []

    def save(self) -> None:
        with atomic_path(self.manifest_path) as tmp:
            tmp.write_text(json.dumps(self.manifest, indent=2, default=str))

    def stage(self, name: str, inputs: Any, step: Callable[[bool], dict[str, Any]], total: int) -> dict[str, Any]:
        """Run `step(resuming)` and record its outputs, or return the recorded outputs if nothing changed."""
        self.order.append(name)
        key = _hash(inputs)
        record = self.manifest["stages"].get(name, {})
        if self.force_from and name.split(":")[0] == self.force_from.split(":")[0]:
            self.forcing = True
        skip = record.get("status") == "done" and record.get("inputs") == key and not self.forcing
        if self.only and name.split(":")[0] != self.only.split(":")[0]:
            if record.get("status") != "done":
                raise SpectuneError(f"--only {self.only}: stage {name} it depends on has not finished")
            skip = True
        elif self.only:  # the named stage reruns even when its inputs are unchanged
            skip = False
        header = f"stage {len(self.order)}/{total}: {name}"
        if skip:
            console.print(f"[dim]{header} (unchanged, skipped)[/]")
            return record["outputs"]
        console.rule(header)
        resuming = record.get("status") == "running" and record.get("inputs") == key
        self.manifest["stages"][name] = {"status": "running", "inputs": key, "started": time.time()}
        self.save()
        start = time.perf_counter()
        outputs = step(resuming)
        self.manifest["stages"][name] = {
            "status": "done",
            "inputs": key,
            "seconds": round(time.perf_counter() - start, 2),
            "outputs": json.loads(json.dumps(outputs, default=str)),
        }
        self.save()
        return self.manifest["stages"][name]["outputs"]


def run_pipeline(config: RunConfig, force_from: str | None = None, only: str | None = None) -> dict[str, Any]:
    """Every stage of a run; returns the summary (also in the manifest and report.md)."""
    from spectune.threads import configure_torch_threads, thread_count

    configure_torch_threads(config.threads)
    run = Run(config, force_from, only)
    methods = config.drafts.methods
    total = 7 + len(methods)
    work = run.dir

    def data_step(_: bool) -> dict[str, Any]:
        if config.data.path == "demo":
            from spectune.data.demo import generate_dialogues
            from spectune.data.read import write_jsonl

            path = work / "data" / "dialogues.jsonl"
            write_jsonl(generate_dialogues(config.data.demo_dialogues, config.data.seed), path)
        else:
            path = Path(config.data.path)
        from spectune.data.prepare import save_split, split_dialogues
        from spectune.data.read import read_dialogues

        dialogues = read_dialogues(path, system=config.data.system).dialogues
        if config.data.eval_data is not None:
            held_out = read_dialogues(config.data.eval_data, system=config.data.system).dialogues
            split = split_dialogues(dialogues, eval_fraction=0.0, seed=config.data.seed)
            split.eval = held_out
        else:
            split = split_dialogues(dialogues, eval_fraction=config.data.eval_fraction, seed=config.data.seed)
        paths = save_split(split, work / "data")
        return {
            "train": str(paths["train"]),
            "eval": str(paths["eval"]),
            "train_dialogues": len(split.train),
            "eval_dialogues": len(split.eval),
            "dropped": dict(split.dropped),
            "hash": _file_hash(paths["train"]),
        }

    data_inputs = {
        "data": config.data.model_dump(mode="json"),
        "file": _file_hash(Path(config.data.path)) if config.data.path != "demo" else None,
    }
    data = run.stage("data", data_inputs, data_step, total)

    def models_step(_: bool) -> dict[str, Any]:
        if config.models.target is not None:
            return {"target": str(config.models.target), "draft": str(config.models.draft), "profile": None}
        from spectune.models.world import build_pair, profile_pair

        folder = build_pair(config.models.size, config.models.models_dir)
        profile = profile_pair(folder)
        return {
            "target": str(folder / "target"),
            "draft": str(folder / "draft"),
            "profile": profile,
            "manifest": str(folder / "manifest.json"),
        }

    models = run.stage("models", config.models.model_dump(mode="json"), models_step, total)

    def finetune_step(resuming: bool) -> dict[str, Any]:
        from spectune.train.target import FinetuneConfig, finetune

        result = finetune(
            FinetuneConfig(
                model=models["target"],
                data=data["train"],
                eval_data=data["eval"],
                out=work / "target",
                resume=resuming,
                seed=config.data.seed,
                **config.finetune.model_dump(),
            )
        )
        return result.model_dump(mode="json")

    tuned = run.stage(
        "finetune", [config.finetune.model_dump(mode="json"), data["hash"], models["target"]], finetune_step, total
    )

    def merge_step(_: bool) -> dict[str, Any]:
        from spectune.train.target import merge

        return merge(Path(models["target"]), Path(tuned["adapter"]), work / "target" / "merged").model_dump(mode="json")

    merged = run.stage("merge", [tuned], merge_step, total)
    drafts = {"generic": models["draft"]}
    for method in methods:

        def draft_step(resuming: bool, method: str = method) -> dict[str, Any]:
            from spectune.train.draft import DraftConfig, train_draft

            result = train_draft(
                DraftConfig(
                    target=merged["model"],
                    draft=models["draft"],
                    data=data["train"],
                    eval_data=data["eval"],
                    out=work / "drafts" / method,
                    method=method,
                    resume=resuming,
                    seed=config.data.seed,
                    **config.drafts.for_method(method),
                )
            )
            return result.model_dump(mode="json")

        inputs = [config.drafts.for_method(method), method, merged, data["hash"]]
        drafts[method] = run.stage(f"draft:{method}", inputs, draft_step, total)["model"]

    def acceptance_step(_: bool) -> dict[str, Any]:
        from spectune.train.acceptance import run_acceptance

        return run_acceptance(
            Path(merged["model"]),
            {n: Path(p) for n, p in drafts.items()},
            Path(data["eval"]),
            n=config.acceptance.n,
            max_new_tokens=config.acceptance.max_new_tokens,
            profile_file=Path(models["manifest"]) if models.get("manifest") else None,
            json_out=work / "acceptance.json",
        )

    accepted = run.stage("acceptance", [config.acceptance.model_dump(), merged, drafts], acceptance_step, total)

    def export_step(_: bool) -> dict[str, Any]:
        from spectune.data.read import read_dialogues
        from spectune.export.pair import export_pair
        from spectune.models.load import load_tokenizer

        tokenizer = load_tokenizer(merged["model"])
        held_out = read_dialogues(data["eval"]).dialogues[: config.export.fidelity_dialogues]
        texts = [tokenizer.apply_chat_template(d.messages, tokenize=False) for d in held_out]
        report = export_pair(
            Path(merged["model"]),
            {n: Path(p) for n, p in drafts.items()},
            work / "gguf",
            config.export.quant,
            texts,
            keep_f16=False,
        )
        files = {name: entry["gguf"] for name, entry in report["models"].items()}
        return {"files": files, "reports": report}

    exported = run.stage("export", [config.export.model_dump(), merged, drafts], export_step, total)

    def bench_step(_: bool) -> dict[str, Any]:
        from spectune.bench.run import BenchConfig, bench

        files = exported["files"]
        section = config.bench
        report = bench(
            BenchConfig(
                target=Path(files["target"]),
                drafts={n: Path(files[n]) for n in drafts},
                data=Path(data["eval"]),
                out=work / "bench",
                n=section.n,
                repeats=section.repeats,
                max_tokens=section.max_tokens,
                draft_max=8 if section.draft_max == "auto" else section.draft_max,
                draft_max_by_draft=best_k(accepted) if section.draft_max == "auto" else None,
                draft_p_min=section.draft_p_min,
                exact=section.exact,
                threads=config.threads,
                peer=section.peer,
            )
        )
        return {"summary": report["summary"], "report": str(work / "bench" / "report.md")}

    benched = run.stage(
        "bench", [config.bench.model_dump(), exported["files"], thread_count(config.threads)], bench_step, total
    )
    summary = summarize(accepted, benched, work)
    run.manifest["summary"] = summary
    run.save()
    write_run_report(run, summary)
    return summary


def best_k(accepted: dict[str, Any]) -> dict[str, int]:
    """Each draft's best k under the memory-bound GPU profile (what the bench's GPU prediction assumes)."""
    gpu = next(p["name"] for p in accepted["profiles"] if p["name"].startswith("gpu"))
    return {row["name"]: max(1, row["best_k"][gpu]) for row in accepted["drafts"]}


def summarize(accepted: dict[str, Any], benched: dict[str, Any], work: Path) -> dict[str, Any]:
    """The run's result in the reference story's terms."""
    alpha = {row["name"]: row["alpha"] for row in accepted["drafts"]}
    bench = benched["summary"]
    names = list(bench)
    identical = sum(bench[name]["identical"] for name in names)
    prompts = sum(bench[name]["n"] for name in names)
    line = (
        "acceptance: "
        + " | ".join(f"{name} {bench[name]['acceptance']:.0%}" for name in names)
        + " — tokens per target pass "
        + " / ".join(f"{bench[name]['mean_accepted_len']:.1f}" for name in names)
        + " — predicted on a GPU "
        + " / ".join(f"{bench[name]['predicted_speedup_gpu']:.1f}x" for name in names)
        + " — here (CPU, compute-bound) "
        + " / ".join(f"{bench[name]['mean_speedup']:.1f}x" for name in names)
        + f" — identical answers {identical}/{prompts} — report: {work / 'report.md'}"
    )
    return {"line": line, "offline_alpha": alpha, "bench": bench}


def write_run_report(run: Run, summary: dict[str, Any]) -> None:
    stages = run.manifest["stages"]
    lines = ["# spectune run", "", summary["line"], "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {record.get('seconds', '-')} |" for name, record in stages.items()]
    bench_md = run.dir / "bench" / "report.md"
    if bench_md.is_file():
        lines += ["", bench_md.read_text()]
    with atomic_path(run.dir / "report.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
