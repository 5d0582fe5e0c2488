"""How an answer is decoded: the one definition of the decoding settings (its length, sampling, the draft's k and
when drafting stops), which `spectune generate`, `bench` and `serve` extend and the speculative decoder reads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from spectune.config import Settings
from spectune.speedup import DEFAULT_DRAFT_MAX

DEFAULT_MAX_TOKENS = 128  # the one default answer length: decoding, the meter's and seqkd's target answers


class DecodeSettings(Settings):
    """Decoding settings (llama.cpp's sampling and speculative parameters, vLLM's SamplingParams)."""

    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="Longest answer, in tokens.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0: greedy (the target's own answer).")
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens only; 0: off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Sample within this probability mass only; 1: off.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Sampling seed (default: a fresh one per answer).")
    stop: list[str] = Field([], description="Strings that end the answer (not part of it).")
    min_tokens: int = Field(0, ge=0, description="No end token before this many tokens.")
    ignore_eos: bool = Field(False, description="No end token at all: every answer runs to max_tokens.")
    draft_max: int | Literal["auto"] = Field(
        "auto",
        description=f"Draft length k; 0: no drafting; auto: the pair's recommended k (its acceptance stage), else "
        f"{DEFAULT_DRAFT_MAX}.",
    )
    draft_p_min: float = Field(0.0, ge=0.0, le=1.0, description="Stop drafting below this draft confidence.")
    adaptive: bool = Field(False, description="Grow k after a fully accepted step, shrink it after a rejection.")

    @field_validator("draft_max")
    @classmethod
    def _not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("draft_max must be >= 0 or auto")
        return value

    @property
    def k(self) -> int:
        """The draft length this decodes with (auto where no recommendation was filled in: the default)."""
        return DEFAULT_DRAFT_MAX if self.draft_max == "auto" else self.draft_max

    def decoding(self) -> DecodeSettings:
        """The decoding settings alone, of a verb's config that extends them (bench's, serve's)."""
        return DecodeSettings.model_validate(self.model_dump(include=set(DecodeSettings.model_fields)))

    def with_k(self, recommended: int | None) -> DecodeSettings:
        """These settings with auto resolved to `recommended` (a measured k; None: the default)."""
        if self.draft_max != "auto":
            return self
        return self.model_copy(update={"draft_max": DEFAULT_DRAFT_MAX if recommended is None else recommended})
