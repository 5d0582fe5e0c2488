"""The server's slots: each one decoder (its own llama.cpp contexts) in the mode chosen at start, and what each
slot's decoder is loaded from."""

from __future__ import annotations

from pathlib import Path

from spectune.data.prepare import read_prompts
from spectune.data.read import assistant_turns
from spectune.errors import SpectuneError
from spectune.runtime.llama import LlamaModel
from spectune.runtime.mode import CALIBRATION_PROMPTS, DecoderSource
from spectune.runtime.ngram import NGRAM, NgramSettings, NgramSetup, NgramTable, domain_of_texts
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.serve.config import ServeConfig


class Slot:
    def __init__(self, decoder: SpeculativeDecoder) -> None:
        self.decoder = decoder  # its own contexts, and its own n-gram conversation table
        self.target = decoder.target
        self.owner: str | None = None  # the caller whose conversation the KV cache holds

    def serve(self, caller: str | None, reuse_prefix: bool) -> None:
        """Keep the cached prompt only for the same caller: another caller must learn nothing of it, not even
        through how many tokens were reused or how fast the first token came."""
        if caller is None or caller != self.owner or not reuse_prefix:
            self.decoder.forget()
        self.owner = caller


def calibration_conversations(data: Path | None, count: int = len(CALIBRATION_PROMPTS)) -> list[list[dict[str, str]]]:
    """What --mode auto measures: the first prompts of a chat dataset, or the built-in phone questions."""
    if data is None:
        return [[{"role": "user", "content": question}] for question in CALIBRATION_PROMPTS]
    conversations = [prompt.messages for prompt in read_prompts(data)[:count]]
    if not conversations:
        raise SpectuneError(f"{data}: no prompt to measure --mode auto on (a chat dataset ending in a user turn)")
    return conversations


def decoder_source(config: ServeConfig) -> DecoderSource:
    """What each slot's decoder is loaded from."""
    assert config.target is not None  # ServeConfig's validator sees to it
    setups: dict[str, NgramSetup] = {}
    if config.ngram:  # n-gram lookup's domain table is built once and read by every slot
        setups[NGRAM] = NgramSetup(config.ngram, domain_table(config.target, config.ngram, config.ngram_data))
    return DecoderSource(
        config.target,
        config.draft,
        config.n_ctx,
        config.threads,
        config.exact,
        config.lookups(config.ngram is not None),
        setups,
    )


def domain_table(target: Path, settings: NgramSettings, data: Path | None) -> NgramTable:
    """An n-gram domain table from a chat dataset's assistant turns, in the target's own tokens (serve, generate)."""
    answers = assistant_turns(data) if data else []
    tokenizer = LlamaModel(target, n_ctx=64, threads=1)  # its weights are mmapped: the slots' pages
    try:
        return domain_of_texts(settings, answers, tokenizer.tokenize)
    finally:
        tokenizer.close()
