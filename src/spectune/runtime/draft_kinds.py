"""The kinds of draft GGUF, one entry each, by the architecture its GGUF names (runtime/registry.py pairs each with
the speculator that runs it): what loading one needs to know (whether its context reads its target's, whether it
keeps a KV cache of its own) and llama.cpp's `--spec-type` for it. Any architecture not here is a draft model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftKind:
    words: str  # what it is, for errors
    spec_type: str  # llama.cpp's --spec-type (common/speculative.cpp of the pinned sources)
    beside_target: bool = False  # its context reads its target's (`ctx_other`): it runs only as that target's draft
    reads_target_cache: bool = False  # keeps no KV cache of its own: llama.cpp's MTP context type


DRAFT_MODEL = DraftKind("a draft model", "draft-simple")
EAGLE3_HEAD = DraftKind("an EAGLE-3 head", "draft-eagle3", beside_target=True)
MTP_ASSISTANT = DraftKind("a Gemma 4 MTP assistant", "draft-mtp", beside_target=True, reads_target_cache=True)
KINDS = {"eagle3": EAGLE3_HEAD, "gemma4-assistant": MTP_ASSISTANT}  # by GGUF general.architecture


def kind_of(architecture: str | None) -> DraftKind:
    return KINDS.get(architecture or "", DRAFT_MODEL)
