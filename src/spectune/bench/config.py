"""`spectune bench`'s settings: the one definition of what the bench takes (flags, YAML, a run config's `bench:`),
and what follows from them per variant (its k, the llama.cpp baselines)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from spectune.engines.llama_server import NgramType
from spectune.layout import CONTROL_DRAFT
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.ngram import NgramSettings
from spectune.runtime.registry import SpeculatorSettings, Variant, check_draft_names
from spectune.threads import LlamaSettings

# llama.cpp's target alone, the baseline, by its key in the rows and how the report says it: with the bench's own
# settings (exact: spectune's identity settings), and at llama.cpp's own defaults (repacked weights, flash attention
# auto, tiled matmul), as a user runs it.
BASELINES = {"llama_cpp": "with this bench's settings", "llama_cpp_defaults": "at its defaults"}


class BenchSettings(DecodeSettings, SpeculatorSettings):
    """The bench's settings: the `bench:` section of a run config and the flags of `spectune bench`."""

    n: int = Field(30, ge=1, description="Prompts.")
    repeats: int = Field(3, ge=1, description="Interleaved timed runs per prompt and variant (medians).")
    peer: bool = Field(False, description="Also run llama.cpp's own speculative decoder on each pair.")
    peer_ngram: NgramType = Field(
        "ngram-simple", description="llama.cpp's n-gram speculator beside the lookup variants (see speculation_flags)."
    )
    first_words_every: int = Field(
        1,
        ge=1,
        description="A new caller's first words (both caches empty, every variant) on every Nth prompt: on long "
        "prompts each costs a prefill per variant.",
    )
    ngram_with: list[str] | None = Field(
        None, description="The drafts n-gram lookup goes in front of (default: every tuned one)."
    )

    @model_validator(mode="after")
    def _comparable(self) -> BenchSettings:
        """What the bench compares must be comparable: answers identical to the target alone's (greedy), and
        llama.cpp's tools decoding the same way (they are given no stop strings, minimum length or ignore_eos)."""
        if self.temperature > 0:
            raise ValueError("the bench checks answers identical to the target alone's: temperature must be 0")
        if self.peer and (self.stop or self.min_tokens or self.ignore_eos):
            raise ValueError("peer: llama.cpp's tools run without stop, min_tokens, ignore_eos: leave them unset")
        return self


class BenchConfig(BenchSettings, LlamaSettings):
    """Everything `spectune bench` takes."""

    target: Path = Field(description="Target GGUF.")
    drafts: dict[str, Path] = Field(description="Draft GGUFs by name.")
    data: Path = Field(description="Prompts: a chat dataset or a `data prompts` file.")
    out: Path = Field(Path("bench"), description="Folder for report.json, report.md, report.png.")
    recommended_k: dict[str, int] = Field({}, description="k per draft where draft_max is auto.")
    ngram: NgramSettings | None = Field(
        None, description="Also n-gram lookup: `ngram` alone, and `ngram+DRAFT` in front of tuned drafts."
    )
    gpu_cost_ratio: dict[str, float] = Field(
        {}, description="c per draft for the GPU prediction (default: what a step reads of the GGUFs)."
    )
    peer_binary: Path | None = Field(None, description="llama-speculative-simple to compare with (default: built).")
    plot: bool = Field(True, description="Also draw PNG plots.")
    ngram_data: Path | None = Field(
        None, description="Chat dataset whose assistant turns fill the n-gram domain table (the target's answers)."
    )

    @model_validator(mode="after")
    def _known_drafts(self) -> BenchConfig:
        check_draft_names(list(self.drafts))
        unknown = sorted(set(self.ngram_with or []) - set(self.drafts))
        if unknown:
            raise ValueError(f"ngram_with: no draft named {', '.join(unknown)} (drafts: {', '.join(self.drafts)})")
        return self

    def variants(self) -> dict[str, Variant]:
        """Every variant by its name, the target alone not included: each draft, then each model-free speculator
        alone and in front of the fronted drafts (ngram_with, default every tuned one)."""
        lookups = self.lookups(self.ngram is not None)
        fronted = self.ngram_with if self.ngram_with is not None else set(self.drafts) - {CONTROL_DRAFT}
        variants = [Variant(draft=name) for name in self.drafts]
        for lookup in lookups:
            variants += [Variant((lookup,)), *(Variant((lookup,), name) for name in self.drafts if name in fronted)]
        return {variant.name: variant for variant in variants}

    def draft_path(self, name: str) -> Path | None:
        """The draft model variant `name` runs (None: model-free speculators alone)."""
        draft = self.variants()[name].draft
        return self.drafts[draft] if draft else None


def baseline_settings(config: BenchConfig) -> dict[str, bool]:
    """Each llama.cpp target-alone baseline --peer runs (one of BASELINES) with its `exact`."""
    if not config.peer:
        return {}
    if not config.exact:  # the bench's own settings are llama.cpp's defaults
        return {"llama_cpp": False}
    return {"llama_cpp": True, "llama_cpp_defaults": False}


def draft_length(config: BenchConfig, name: str) -> int:
    """k for this variant (0 for the target alone); a lookup in front of a draft drafts as far as the draft does
    where the meter did not measure the pair."""
    variant = config.variants().get(name)
    if variant is None:
        return 0
    measured = config.recommended_k.get(name, config.recommended_k.get(variant.draft or ""))
    return config.with_k(measured).k
