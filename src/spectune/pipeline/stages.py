"""The stage table: each stage a function of the run's context that calls the entry function its CLI verb
calls, with the settings, outputs and files it reads (what the runner hashes)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectune.acceptance.stage import AcceptanceConfig, run_acceptance
from spectune.atomic import atomic_path
from spectune.bench.config import BenchConfig
from spectune.bench.run import bench
from spectune.cache import path_hash
from spectune.data.demo import generate_dialogues
from spectune.data.prepare import split_dialogues
from spectune.data.read import read_dialogues, write_jsonl
from spectune.export.pair import ExportPairConfig, export_models, write_pair
from spectune.export.profile import profile_pair
from spectune.layout import CONTROL_DRAFT, TARGET, RunLayout
from spectune.models.demo_pair import build_pair
from spectune.models.derive import derive_draft
from spectune.models.gemma4_pair import GEMMA4_RECIPES, build_gemma4_pair
from spectune.models.imported import fetch
from spectune.models.load import read_config
from spectune.models.mtp_assistant import check_fit
from spectune.models.resolve import is_hub_id, model_folder, resolve_model
from spectune.pipeline.config import DERIVED_LAYERS, DRAFT_FIELDS, TARGET_FIELDS, RunConfig
from spectune.threads import thread_count
from spectune.train.assistant import ASSISTANT, AssistantConfig, train_assistant
from spectune.train.draft import (
    TARGET_ANSWERS,
    DraftConfig,
    train_draft,
)
from spectune.train.eagle3 import EAGLE3, Eagle3Config, check_target, train_eagle3
from spectune.train.target import FinetuneConfig, MergeConfig, finetune, merge


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
        if self.config.drafts.assistant is not None:
            head[ASSISTANT] = Path(self.outputs[ASSISTANT]["model"])
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
    A target an EAGLE-3 head cannot draft for in llama.cpp, or an MTP assistant that cannot read the target's cache,
    is refused here, before any training."""
    section = context.config.models
    if section.fetch is not None or section.target is not None:
        target = fetch(section.fetch) if section.fetch is not None else resolve_model(section.target)
        if context.config.drafts.eagle3 is not None:
            check_target(target)
        if context.config.drafts.assistant is not None and isinstance(section.draft, Path):
            assistant = resolve_model(
                section.draft
            )  # the assistant as shipped: refused now if it cannot read the target
            check_fit(target, read_config(target), assistant, read_config(assistant))
        return {"target": str(target)}
    if section.size in GEMMA4_RECIPES:
        folder = build_gemma4_pair(section.size, section.models_dir)
    else:
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
        **context.config.draft_settings(method),
    )
    return {**train_draft(config).model_dump(mode="json"), "eval_hash": path_hash(context.layout.eval_file)}


def eagle3_stage(context: Context) -> dict[str, Any]:
    """The EAGLE-3 head, on the tuned target's own answers where seqkd made them (else the train dialogues)."""
    settings = context.config.drafts.eagle3
    assert settings is not None  # the stage exists only with a drafts.eagle3 section
    inputs = train_inputs(context, context.layout.draft_dir(EAGLE3)) | {"data": domain_data(context)}
    result = train_eagle3(Eagle3Config(target=context.merged, **inputs, **settings.model_dump()))
    return {**result.model_dump(mode="json"), "eval_hash": path_hash(context.layout.eval_file)}


def assistant_stage(context: Context) -> dict[str, Any]:
    """The MTP assistant as shipped (the base draft), retuned for the tuned target on its own answers where seqkd
    made them (else the train dialogues)."""
    settings = context.config.drafts.assistant
    assert settings is not None  # the stage exists only with a drafts.assistant section
    inputs = train_inputs(context, context.layout.draft_dir(ASSISTANT)) | {"data": domain_data(context)}
    shipped = Path(context.outputs["base-draft"]["draft"])
    config = AssistantConfig(target=context.merged, assistant=shipped, **inputs, **settings.model_dump())
    return {**train_assistant(config).model_dump(mode="json"), "eval_hash": path_hash(context.layout.eval_file)}


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
        calibration_data=context.layout.train_file,
        threads=context.config.threads,
        **context.config.export.model_dump(),
    )


def export_stage(context: Context) -> dict[str, Any]:
    """The GGUFs and their checks; the acceptance stage measures them and writes the pair to serve (pair.json)."""
    report = export_models(export_config(context))
    return {"files": {name: entry["gguf"] for name, entry in report["models"].items()}, "reports": report}


def acceptance_stage(context: Context) -> dict[str, Any]:
    """The offline meter, c from the exported GGUFs (one c for choosing k and for the bench's prediction); then the
    pair to serve, at its recommended k."""
    ggufs = {name: context.layout.gguf(name) for name in (TARGET, *context.drafts())}
    ngram = context.config.drafts.ngram
    weighted = context.outputs["export"]["reports"]["imatrix"]["used"]  # a draft's other types quantized alike
    config = acceptance_config(
        context,
        context.drafts(),
        json_out=context.layout.acceptance,
        ggufs=ggufs,
        ngram=ngram,
        ngram_data=domain_data(context) if ngram else None,
        calibration_data=context.layout.train_file if weighted else None,
        threads=context.config.threads,
    )
    report = run_acceptance(config)
    return report | write_pair(export_config(context), report)


def bench_stage(context: Context) -> dict[str, Any]:
    layout = context.layout
    config = BenchConfig(
        target=layout.gguf(TARGET),
        drafts={name: served_gguf(context, name) for name in context.drafts()},
        data=layout.eval_file,
        out=layout.bench_dir,
        recommended_k={row["name"]: row["recommended_k"] for row in context.outputs["acceptance"]["drafts"]},
        threads=context.config.threads,
        ngram=context.config.drafts.ngram,
        ngram_data=domain_data(context) if context.config.drafts.ngram else None,
        **context.config.bench.model_dump(),
    )
    return {"summary": bench(config)["summary"], "report": str(layout.bench_dir / "report.md")}


def served_gguf(context: Context, name: str) -> Path:
    """A draft's GGUF at the type the acceptance stage chose for it (the export's where it measured none)."""
    swept = context.outputs["acceptance"].get("draft_types", {}).get("drafts", {})
    return Path(swept[name]["gguf"]) if name in swept else context.layout.gguf(name)


def domain_data(context: Context) -> Path:
    """What fills the n-gram domain table: the tuned target's own answers where seqkd made them, else the train
    dialogues the target was tuned on."""
    answers = context.layout.draft_dir("seqkd") / TARGET_ANSWERS
    return answers if "seqkd" in context.config.drafts.methods and answers.is_file() else context.layout.train_file


def _train_file(context: Context) -> list[Path]:
    return [context.layout.train_file]


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


def _export_files(context: Context) -> list[Path]:
    """The held-out file fidelity is measured on, and the train file the importance matrices are computed on."""
    return [context.layout.eval_file, *([context.layout.train_file] if context.config.export.imatrix != "off" else [])]


def _data_files(context: Context) -> list[Path]:
    section = context.config.data
    return [path for path in (section.path, section.eval_data) if isinstance(path, Path)]


def head_stages(config: RunConfig, seqkd: tuple[str, ...]) -> list[Stage]:
    """The drafts that read the tuned target's states, each where its section is given: an EAGLE-3 head (from seqkd's
    answers where there are) and the retuned MTP assistant (from the base draft, the assistant as shipped)."""
    heads = []
    if config.drafts.eagle3 is not None:
        heads.append(
            Stage(EAGLE3, eagle3_stage, lambda c: [c.drafts.eagle3, c.data.seed], ("merge", *seqkd), _domain_file)
        )
    if config.drafts.assistant is not None:
        heads.append(
            Stage(
                ASSISTANT,
                assistant_stage,
                lambda c: [c.drafts.assistant, c.data.seed],
                ("base-draft", "merge", *seqkd),
                _domain_file,
            )
        )
    return heads


def stages(config: RunConfig) -> list[Stage]:
    """The pipeline: each stage with the settings it reads, the stages it needs and the files it reads."""
    drafts = tuple(f"draft:{method}" for method in config.drafts.methods)
    seqkd = tuple(name for name in drafts if name == "draft:seqkd")  # its answers are the heads' data
    heads = head_stages(config, seqkd)
    head = tuple(stage.name for stage in heads)
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
                lambda c, method=method: [c.draft_settings(method), c.data.seed],
                ("base-draft", "merge", *(f"draft:{m}" for m in [config.drafts.start_from.get(method)] if m)),
                _train_file,
            )
            for method in config.drafts.training_order()
        ),
        *heads,
        Stage("export", export_stage, lambda c: [c.export, c.threads], (*bases, *drafts, *head), _export_files),
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
