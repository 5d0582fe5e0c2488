"""The server's slots: each one decoder (its own llama.cpp contexts) in the mode chosen at start, and what each
slot's decoder is loaded from."""

from __future__ import annotations

from pathlib import Path

from spectune.data.read import assistant_turns, read_dialogues
from spectune.errors import SpectuneError
from spectune.runtime.kv_state import load_decoder
from spectune.runtime.llama import LlamaModel
from spectune.runtime.mode import CALIBRATION_PROMPTS, DecoderSource
from spectune.runtime.ngram import NGRAM, NgramSettings, NgramSetup, NgramTable, domain_of_texts
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.serve.config import ServeConfig
from spectune.serve.prefix_cache import Caller, PrefixStore, Reuse, best_reuse


class Slot:
    def __init__(self, decoder: SpeculativeDecoder) -> None:
        self.decoder = decoder  # its own contexts, and its own n-gram conversation table
        self.target = decoder.target
        self.owner: Caller | None = None  # the caller whose conversation the caches hold

    def prepare(self, caller: Caller, prompt: list[int], shared: int, store: PrefixStore, reuse: bool) -> int:
        """Set the caches to the longest prefix of `prompt` this caller may reuse (prefix_cache.py says which);
        the tokens reused. Whatever else they held is dropped: the next caller learns nothing of it, not even
        through how many tokens were reused or how fast the first token came."""
        choice = best_reuse(store, caller, self.owner, self.target.cached, prompt, shared) if reuse else Reuse(0)
        if choice.state is not None:
            load_decoder(self.decoder, choice.state)
        elif choice.length == 0:
            self.decoder.forget()
        self.owner = caller
        return choice.length


SLOT_OVERHEAD_BYTES = 64 << 20  # a slot's compute buffers and logits, beside its caches and weights
MEMORY_HEADROOM = 0.9  # of the memory available: what the slots may take, leaving the rest to the system


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where the system does not say)."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_slot_memory(first: SpeculativeDecoder, slots: int, mode: str) -> None:
    """Refuse, before loading them, more slots than the memory left holds (each its caches, and in the fastest
    mode its repacked weights), naming the numbers; measured off the first slot's models."""
    each = SLOT_OVERHEAD_BYTES + sum(model.memory_bytes() for model in first.models)
    need, available = (slots - 1) * each, available_memory()
    if available is not None and need > MEMORY_HEADROOM * available:
        mib = 1 << 20
        raise SpectuneError(
            f"--slots {slots}: each slot past the first needs about {each // mib} MiB in --mode {mode} (its KV caches"
            f"{', its repacked weights' if mode == 'fastest' else ''}); {slots - 1} need {need // mib} MiB and "
            f"{available // mib} MiB is available: lower --slots or --n-ctx"
        )


def calibration_conversations(data: Path | None, count: int = len(CALIBRATION_PROMPTS)) -> list[list[dict[str, str]]]:
    """What --mode auto measures: the first prompts of a chat dataset, or the built-in phone questions."""
    if data is None:
        return [[{"role": "user", "content": question}] for question in CALIBRATION_PROMPTS]
    conversations = []
    for dialogue in read_dialogues(data, need_answer=False).dialogues:  # answered or not: each up to its last question
        users = [index for index, turn in enumerate(dialogue.messages) if turn["role"] == "user"]
        conversations += [dialogue.messages[: users[-1] + 1]] if users else []
    if not conversations:
        raise SpectuneError(f"{data}: no prompt to measure --mode auto on (a chat dataset with a user turn)")
    return conversations[:count]


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
        config.gpu_layers,
    )


def domain_table(target: Path, settings: NgramSettings, data: Path | None) -> NgramTable:
    """An n-gram domain table from a chat dataset's assistant turns, in the target's own tokens (serve, generate)."""
    answers = assistant_turns(data) if data else []
    tokenizer = LlamaModel(target, n_ctx=64, threads=1)  # its weights are mmapped: the slots' pages
    try:
        return domain_of_texts(settings, answers, tokenizer.tokenize)
    finally:
        tokenizer.close()
