"""Tokenizer identity: llama.cpp must split text into exactly the tokens HF does, or a model trained on HF's
tokens is served different ones. Checked on stress strings (whitespace runs, digits, unicode, chat markup) and on
the user's own texts; every mismatch is named."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spectune.data.demo import generate_dialogues
from spectune.errors import SpectuneError
from spectune.models.corpus import EMOJI, GREETINGS, generate_corpus
from spectune.runtime.chat import chat_prompt
from spectune.runtime.llama import LlamaModel

STRESS_STRINGS = 2000
SHOWN_MISMATCHES = 10


def tokenizer_strings(n: int, seed: int = 0) -> list[str]:
    """Strings that stress a tokenizer: prose, code, digits, unicode, emoji, whitespace runs, chat markup."""
    rng = random.Random(seed)
    turns = [t["content"] for d in generate_dialogues(100, seed=seed) for t in d.messages]
    pieces = [
        *generate_corpus(100, seed=seed),
        *turns,
        *GREETINGS,
        *EMOJI,
        "  ",
        "\n\n\n",
        "\t \t",
        "   x",
        "1234567890",
        "3.14159",
        "1,000,000",
        "don't",
        "I'VE",
        "ＡＢＣ",
        "e\u0301",
        "\u200d",
        "a  b   c",
        " leading",
        "trailing  ",
        "x\r\ny",
        "€£¥",
        "ğüşöç",
        "<|im_start|>user\n",
        "<|im_end|>\n",
    ]
    separators = ["", " ", "  ", "\n", "\t", "\n\n  "]
    return [
        "".join(rng.choice(pieces)[: rng.randint(1, 60)] + rng.choice(separators) for _ in range(rng.randint(1, 6)))
        for _ in range(n)
    ]


def tokenizer_mismatches(hf_tokenizer: Any, gguf: Path, texts: Sequence[str]) -> list[str]:
    """Each text llama.cpp tokenizes unlike HF (special tokens parsed by both), with the first tokens that differ."""
    model = LlamaModel(gguf, n_ctx=64, threads=1)
    mismatches = []
    try:
        for text in texts:
            expected = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
            got = model.tokenize(text)
            if expected != got:
                at = next((i for i, pair in enumerate(zip(expected, got, strict=False)) if pair[0] != pair[1]), None)
                at = min(len(expected), len(got)) if at is None else at
                hf_pieces = [hf_tokenizer.decode([token]) for token in expected[at : at + 3]]
                llama_pieces = [model.detokenize([token]) for token in got[at : at + 3]]
                mismatches.append(f"{text[:60]!r}: from token {at}, HF {hf_pieces} but llama.cpp {llama_pieces}")
    finally:
        model.close()
    return mismatches


def template_mismatches(hf_tokenizer: Any, gguf: Path, conversations: Sequence[list[dict[str, str]]]) -> list[str]:
    """Each prompt (a conversation up to one of its assistant turns) that the GGUF's chat template, rendered as the
    runtime and the server render it, writes unlike HF's apply_chat_template (what training rendered)."""
    model = LlamaModel(gguf, n_ctx=64, threads=1)
    mismatches = []
    try:
        for messages in conversations:
            for end in (index for index, message in enumerate(messages) if message["role"] == "assistant"):
                expected = hf_tokenizer.apply_chat_template(messages[:end], tokenize=False, add_generation_prompt=True)
                got = chat_prompt(model, messages[:end])
                if expected != got:
                    at = next((i for i, pair in enumerate(zip(expected, got, strict=False)) if pair[0] != pair[1]), 0)
                    mismatches.append(
                        f"from character {at}: HF {expected[at : at + 40]!r} but GGUF {got[at : at + 40]!r}"
                    )
    finally:
        model.close()
    return mismatches


def _raise_named(gguf: Path, summary: str, mismatches: list[str]) -> None:
    more = len(mismatches) - SHOWN_MISMATCHES
    shown = "\n  ".join(mismatches[:SHOWN_MISMATCHES] + ([f"... and {more} more"] if more > 0 else []))
    raise SpectuneError(f"{gguf}: {summary}:\n  {shown}")


def check_template(hf_tokenizer: Any, gguf: Path, conversations: Sequence[list[dict[str, str]]]) -> int:
    """Raise naming every prompt the GGUF's template renders unlike HF's; returns how many prompts were checked."""
    mismatches = template_mismatches(hf_tokenizer, gguf, conversations)
    checked = sum(message["role"] == "assistant" for messages in conversations for message in messages)
    if mismatches:
        _raise_named(gguf, f"its chat template renders {len(mismatches)} of {checked} prompts unlike HF's", mismatches)
    return checked


def check_tokenizer(hf_tokenizer: Any, gguf: Path, texts: Sequence[str] = ()) -> int:
    """Raise naming every mismatch on the stress strings and `texts`; returns how many strings were checked."""
    checked = [*texts, *tokenizer_strings(STRESS_STRINGS)]  # the user's own texts named first
    mismatches = tokenizer_mismatches(hf_tokenizer, gguf, checked)
    if mismatches:
        summary = f"llama.cpp tokenizes {len(mismatches)} of {len(checked)} strings unlike HF's tokenizer"
        _raise_named(gguf, summary, mismatches)
    return len(checked)
