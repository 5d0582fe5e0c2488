"""A run config (`spectune run CONFIG.yaml`): its sections, one per stage, and the built-in demo's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from spectune.acceptance.stage import AcceptanceSettings
from spectune.bench.config import BenchSettings
from spectune.config import Settings, read_yaml, validate
from spectune.data.demo import DemoDataSettings
from spectune.data.prepare import SplitSettings
from spectune.errors import Problem, SpectuneError
from spectune.export.gguf import check_quant
from spectune.export.pair import ExportSettings
from spectune.layout import DEFAULT_QUANT, RunLayout
from spectune.models.demo_pair import RECIPES
from spectune.models.gemma4_pair import GEMMA4_RECIPES
from spectune.models.imported import REAL_MODELS
from spectune.models.resolve import MODEL_REFERENCE, is_hub_id
from spectune.runtime.ngram import NgramSettings
from spectune.threads import ThreadsSettings
from spectune.train.assistant import AssistantSettings
from spectune.train.draft import (
    DEFAULT_DIVERGENCE,
    TARGET_PATH_METHODS,
    DraftSettings,
    Method,
    method_problems,
)
from spectune.train.eagle3 import Eagle3Settings
from spectune.train.target import FinetuneSettings


class DataSettings(SplitSettings, DemoDataSettings):
    path: Path | Literal["demo"] = Field("demo", description="Task dataset, or demo: generated voice-bot dialogues.")


# On SmolLM2 the first two of the target's layers beat layers 0 and 29 and four layers (draft_shapes_smollm2_sgd.md,
# in git at fac0e59).
DERIVED_LAYERS = [0, 1]


class ModelsSettings(Settings):
    size: Literal[tuple(RECIPES) + tuple(GEMMA4_RECIPES)] | None = Field(  # type: ignore[valid-type]
        "small", description="A demo-world pair (a gemma4-* one: a Gemma 4 target and its MTP assistant) ..."
    )
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
        "(else the train dialogues); exported, measured by acceptance and benched as `eagle3`; spectune's loop "
        "and llama.cpp's run it. Needs a target llama.cpp takes layer inputs from.",
    )
    assistant: AssistantSettings | None = Field(
        None,
        description="Retune the Gemma 4 target's MTP assistant (the base draft: a gemma4-* pair's, or models.draft) "
        "for the tuned target ({} for the defaults), on seqkd's target answers where there are (else the train "
        "dialogues); exported, measured and benched as `assistant` beside the one as shipped (`generic`).",
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

    def for_method(self, method: str, served_quant: str = DEFAULT_QUANT) -> dict[str, Any]:
        """The draft settings of one method, its overrides applied; the loss resolved for the methods that have one
        and the answering file's type (else `served_quant`) for those trained on the target's answers (a changed
        default then reruns what it trained; the others do not hold it)."""
        settings = {**self.model_dump(include=set(DraftSettings.model_fields)), **self.overrides.get(method, {})}
        if method in DEFAULT_DIVERGENCE:
            settings["divergence"] = DraftSettings.model_validate(settings).divergence_for(method)
        answers_quant = settings.pop("answers_quant")
        if method in TARGET_PATH_METHODS:
            settings["answers_quant"] = answers_quant or check_quant(served_quant)
        return settings


# What the target stage and the base-draft stage each read of `models:`, so a new draft shape reruns the drafts,
# not the fine-tune.
TARGET_FIELDS = {"size", "fetch", "target", "models_dir"}
DRAFT_FIELDS = {"draft", "draft_layers"}


class RunConfig(ThreadsSettings):
    run_dir: Path = Field(Path("runs/demo"), description="Where every artifact of the run goes.")
    data: DataSettings = DataSettings()
    models: ModelsSettings = ModelsSettings()
    finetune: FinetuneSettings = FinetuneSettings()
    drafts: DraftsSettings = DraftsSettings()
    acceptance: AcceptanceSettings = AcceptanceSettings()
    export: ExportSettings = ExportSettings()
    bench: BenchSettings = BenchSettings()

    @model_validator(mode="after")
    def _assistant_pair(self) -> RunConfig:
        """A Gemma 4 demo pair's draft is its MTP assistant: only drafts.assistant trains it."""
        if self.models.size in GEMMA4_RECIPES and (self.drafts.methods or self.drafts.eagle3 is not None):
            raise ValueError(
                f"models.size {self.models.size}: its draft is an MTP assistant, which drafts.methods and "
                "drafts.eagle3 cannot train; set drafts.methods: [] and retune it with drafts.assistant"
            )
        return self

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir, check_quant(self.export.quant))

    def draft_settings(self, method: str) -> dict[str, Any]:
        """One draft method's settings in this run: the target's answers come from the type it is served at."""
        return self.drafts.for_method(method, self.export.quant)


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
    # The story on Gemma 4's own drafter: the assistant trained for the base target, then retuned for the tuned one.
    "gemma4-demo": {
        "data": {"eval_fraction": 0.125},
        # 64 steps (the Llama demo's) left this narrower target answering "IIII...": 150 give it turns to draft
        "finetune": {"max_steps": 150, "lr": 2e-3, "max_seq_length": 256},
        "drafts": {"methods": [], "assistant": {"max_steps": 150, "lr": 1e-3, "max_seq_length": 256}},
        "acceptance": {"n": 226, "max_tokens": 48, "draft_types": []},
        "bench": {"n": 226, "repeats": 1, "max_tokens": 48},  # every held-out prompt: the goal counts over 200
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
    default_dir = Path("runs") / (size if size.startswith("demo") or size in GEMMA4_RECIPES else f"demo-{size}")
    values = {"run_dir": str(run_dir or default_dir), "models": {"size": size}, **DEMO_SETTINGS[size]}
    return validate(RunConfig, values, "demo")


def load_run_config(path: Path) -> RunConfig:
    config = validate(RunConfig, read_yaml(path), str(path))
    check_paths(config, str(path))
    return config
