"""llama.cpp's own rule for a speculative pair (common/speculative.cpp), checked before a draft is used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spectune.errors import SpectuneError
from spectune.runtime.llama import VocabInfo, read_vocab

VOCAB_SIZE_SLACK = 128  # vocab sizes may differ by this much
FIRST_CHECKED_TOKEN = 5  # token texts must be equal from this id on


def check_pair(target_gguf: Path, draft_gguf: Path) -> dict[str, Any]:
    """Refuse a pair llama.cpp would refuse, naming the first mismatch."""
    target, draft = read_vocab(target_gguf), read_vocab(draft_gguf)
    problems = pair_problems(target, draft)
    if problems:
        raise SpectuneError(f"{draft_gguf} cannot draft for {target_gguf}: " + "; ".join(problems))
    return {
        "vocab_type": target.vocab_type,
        "target_tokens": target.n_tokens,
        "draft_tokens": draft.n_tokens,
        "bos": target.bos,
        "eos": target.eos,
    }


def pair_problems(target: VocabInfo, draft: VocabInfo) -> list[str]:
    problems = []
    for field in ("vocab_type", "bos", "eos", "add_bos", "add_eos"):
        if getattr(target, field) != getattr(draft, field):
            problems.append(f"{field} differs (target {getattr(target, field)}, draft {getattr(draft, field)})")
    if abs(target.n_tokens - draft.n_tokens) > VOCAB_SIZE_SLACK:
        problems.append(f"vocab sizes differ by more than {VOCAB_SIZE_SLACK} ({target.n_tokens} vs {draft.n_tokens})")
    for token in range(FIRST_CHECKED_TOKEN, min(target.n_tokens, draft.n_tokens)):
        if target.texts[token] != draft.texts[token]:
            problems.append(f"token {token} differs: target {target.texts[token]!r}, draft {draft.texts[token]!r}")
            break
    return problems
