"""Every speculator a variant may name, and `Variant`: which speculators a decoder asks, in order.

A variant is written as its parts joined by "+", model-free speculators first and a draft model (by the name the
verb gave it) last: `seqkd`, `ngram`, `ngram+seqkd`. llama.cpp's `--spec-type ngram-simple,draft` is the same list
(engines/llama_server.py derives it from the Variant). Parsing and naming happen here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from spectune.config import Settings
from spectune.errors import SpectuneError
from spectune.runtime.draft_kinds import DRAFT_MODEL, EAGLE3_HEAD, MTP_ASSISTANT, DraftKind
from spectune.runtime.draft_model import DraftModel
from spectune.runtime.eagle3_head import Eagle3Head
from spectune.runtime.llama import LlamaModel
from spectune.runtime.mtp_assistant import MtpAssistant
from spectune.runtime.ngram import NGRAM, NgramSettings, NgramSetup, NgramSpeculator
from spectune.runtime.speculators import Speculator

# A maker builds a fresh speculator for a target from what the verb was given for it (None: its defaults): each
# decoder gets its own, so what one learns of a conversation stays in its slot.
Maker = Callable[[LlamaModel, Any], Speculator]


def make_ngram(target: LlamaModel, setup: NgramSetup | None) -> Speculator:
    return NgramSpeculator(setup or NgramSetup(NgramSettings()), target.is_end)


# The speculator that runs each kind of draft GGUF (runtime/draft_kinds.py), one line a kind, made from the draft's
# model and its target.
MODEL_SPECULATORS: dict[DraftKind, Callable[[LlamaModel, LlamaModel], Speculator]] = {
    DRAFT_MODEL: DraftModel,
    EAGLE3_HEAD: Eagle3Head,
    MTP_ASSISTANT: MtpAssistant,
}

# The model-free speculators, by the name a variant gives them (a draft model is not here: it is named by the verb).
SPECULATORS: dict[str, Maker] = {NGRAM: make_ngram}

SEPARATOR = "+"


def check_speculators(names: list[str]) -> list[str]:
    """The names, each a registered speculator (for settings' validators: a ValueError names what is known)."""
    unknown = [name for name in names if name not in SPECULATORS]
    if unknown:
        raise ValueError(f"no speculator named {', '.join(unknown)} (known: {', '.join(SPECULATORS)})")
    return names


class SpeculatorSettings(Settings):
    """The model-free speculators a verb asks before the draft (the one definition of the setting)."""

    speculators: list[str] = Field(
        [],
        description="Model-free speculators asked before the draft, in this order (runtime/registry.py; n-gram "
        "lookup by --ngram); the bench runs each alone and in front of the tuned drafts.",
    )

    @field_validator("speculators")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        return check_speculators(names)

    def lookups(self, ngram: bool) -> tuple[str, ...]:
        """The model-free speculators in front of the draft: n-gram lookup first where the verb turns it on, then
        the others named, each once."""
        return tuple(dict.fromkeys([*[NGRAM] * ngram, *self.speculators]))


def check_draft_names(names: list[str]) -> None:
    """Draft names a variant can be parsed back from: no separator, no registered speculator's name."""
    for name in names:
        if SEPARATOR in name or name in SPECULATORS:
            raise ValueError(f"draft name {name!r}: may not contain {SEPARATOR!r} nor be a speculator's name")


@dataclass(frozen=True)
class Variant:
    lookups: tuple[str, ...] = ()  # registered model-free speculators, asked in this order
    draft: str | None = None  # the draft model, asked last (its name as the verb gave it)

    @classmethod
    def parse(cls, name: str) -> Variant:
        parts = name.split(SEPARATOR)
        draft = None if parts[-1] in SPECULATORS else parts.pop()
        unknown = [part for part in parts if part not in SPECULATORS]
        if unknown or not name:
            raise SpectuneError(
                f"variant {name!r}: {', '.join(unknown) or 'empty'} is no speculator (known: {', '.join(SPECULATORS)};"
                " a draft model comes last)"
            )
        return cls(tuple(parts), draft)

    @property
    def name(self) -> str:
        return SEPARATOR.join([*self.lookups, *([self.draft] if self.draft else [])])

    def __str__(self) -> str:
        return self.name

    def speculators(
        self, target: LlamaModel, draft_model: LlamaModel | None, setups: dict[str, Any]
    ) -> list[Speculator]:
        """Fresh speculators in the variant's order; `draft_model` is the loaded model its draft names."""
        if (self.draft is None) != (draft_model is None):
            raise SpectuneError(f"variant {self.name}: a draft model is needed exactly where the variant names one")
        members = [SPECULATORS[name](target, setups.get(name)) for name in self.lookups]
        if draft_model is None:
            return members
        return [*members, model_speculator(draft_model, target)]


def model_speculator(draft_model: LlamaModel, target: LlamaModel) -> Speculator:
    """The speculator a draft GGUF is, by its kind: a draft model with its own cache, or a head that drafts from the
    target's states."""
    return MODEL_SPECULATORS[draft_model.kind](draft_model, target)
