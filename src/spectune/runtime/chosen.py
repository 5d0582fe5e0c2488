"""pair.json: the pair a run serves, as export/pair.py writes it and everything else reads it (serve, the engines'
hand-offs, the demo's story, the benchmarks). Read here and nowhere else, validated with a clear error."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spectune.atomic import atomic_path
from spectune.errors import SpectuneError
from spectune.runtime.ngram import NGRAM, NgramSettings
from spectune.runtime.registry import Variant

# The entries that name files: written relative to pair.json's folder, so a run folder can be moved and served from
# anywhere, and read back as paths that work from any directory.
PATH_FIELDS = ("target", "draft", "target_hf", "draft_hf", "ngram_data")


class ChosenPair(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: Path = Field(description="The target's GGUF.")
    draft: Path = Field(description="The served draft's GGUF (an EAGLE-3 head's or an MTP assistant's).")
    draft_name: str = Field(description="The draft's name in the run (`drafts.methods`, a cut, `base`).")
    k: int = Field(ge=0, description="Its k: the acceptance stage's recommended k, else the default.")
    ngram: NgramSettings | None = Field(None, description="n-gram lookup's settings where it goes in front.")
    ngram_data: Path | None = Field(None, description="The answers that fill n-gram lookup's domain table.")
    draft_k: int | None = Field(
        None, ge=0, description="The draft's own recommended k without lookup in front (for the hand-off); None: k."
    )
    eagle3: bool = Field(False, description="The draft is an EAGLE-3 head (it runs beside the target).")
    mtp: bool = Field(False, description="The draft is a Gemma 4 MTP assistant (it reads the target's cache).")
    target_hf: Path | None = Field(None, description="The HF folder of the target (vLLM's, SGLang's input).")
    draft_hf: Path | None = Field(None, description="The HF folder of the draft.")

    @property
    def alone_k(self) -> int:
        """k for the draft alone: what vLLM and SGLang run, which chain no n-gram lookup in front of it."""
        return self.k if self.draft_k is None else self.draft_k

    @property
    def variant(self) -> Variant:
        return Variant((NGRAM,) if self.ngram else (), self.draft_name)

    @classmethod
    def read(cls, path: Path) -> ChosenPair:
        """The pair a pair.json names, its files as paths from here."""
        if not path.is_file():
            raise SpectuneError(f"{path.parent}: no {path.name}; is this a finished `spectune run` folder?")
        try:
            pair = cls.model_validate(json.loads(path.read_text()))
        except (ValueError, ValidationError) as error:
            raise SpectuneError(f"{path}: not a pair spectune wrote: {error}") from error
        return pair.model_copy(
            update={key: path.parent / getattr(pair, key) for key in PATH_FIELDS if getattr(pair, key)}
        )

    def write(self, path: Path) -> None:
        """Atomically, every file relative to `path`'s folder (they must lie under it or beside it)."""
        relative = {key: _relative(getattr(self, key), path.parent) for key in PATH_FIELDS if getattr(self, key)}
        with atomic_path(path) as tmp:
            tmp.write_text(self.model_copy(update=relative).model_dump_json(indent=2))


def _relative(file: Path, folder: Path) -> Path:
    return Path(os.path.relpath(file.resolve(), folder.resolve()))
