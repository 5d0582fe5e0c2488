"""`spectune generate`: an answer, or a conversation, at the terminal, decoded as the server decodes (the same mode
rule, speculators and settings), its statistics printed after each turn."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from spectune.errors import SpectuneError
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.mode import DecoderSource, ModeSettings, choose
from spectune.runtime.ngram import NGRAM, NgramSettings, NgramSetup
from spectune.runtime.registry import SpeculatorSettings
from spectune.runtime.stats import Stats
from spectune.serve.slots import calibration_conversations, domain_table
from spectune.threads import LlamaSettings


class GenerateConfig(DecodeSettings, ModeSettings, LlamaSettings, SpeculatorSettings):
    """Everything `spectune generate` takes."""

    target: Path = Field(description="Target GGUF.")
    draft: Path | None = Field(None, description="Draft GGUF (speculative decoding).")
    prompt: str | None = Field(None, description="One user message; omit with --chat.")
    chat: bool = Field(False, description="An interactive conversation.")
    system: str | None = Field(None, description="System prompt.")
    ngram_data: Path | None = Field(
        None, description="N-gram lookup in front of the draft, its domain table from this chat dataset's answers."
    )


def decoder_source(config: GenerateConfig) -> DecoderSource:
    """n-gram lookup where --ngram-data gives it a domain table (or --speculators names it), then the rest."""
    lookups = config.lookups(config.ngram_data is not None)
    setups: dict[str, NgramSetup] = {}
    if NGRAM in lookups:
        settings = NgramSettings()
        setups[NGRAM] = NgramSetup(settings, domain_table(config.target, settings, config.ngram_data))
    return DecoderSource(config.target, config.draft, config.n_ctx, config.threads, config.exact, lookups, setups)


def generate(
    config: GenerateConfig,
    show: Callable[[str], bool],
    ask: Callable[[], str],
    log: Callable[[str], None],
) -> None:
    """Stream each answer to `show`; with --chat, the next user turn comes from `ask`; lines for the user to `log`."""
    if config.prompt is None and not config.chat:
        raise SpectuneError("give --prompt TEXT or --chat")
    conversations = calibration_conversations(config.calibration_data)
    _, decoder = choose(config.mode, decoder_source(config), conversations, config.decoding(), log, config.recalibrate)
    model = decoder.target
    prompt = config.prompt
    messages = [{"role": "system", "content": config.system}] if config.system else []
    while True:
        messages.append({"role": "user", "content": prompt if prompt is not None else ask()})
        prompt = None  # with --chat, --prompt is the first turn only
        generation = decoder.generate(model.tokenize(chat_prompt(model, messages)), config, show)
        messages.append({"role": "assistant", "content": generation.text})
        log(turn_line(generation.stats))
        if not config.chat:
            return


def turn_line(stats: Stats) -> str:
    return (
        f"\n[dim]{stats.generated} tokens, {stats.tokens_per_second:.1f} tok/s, TTFT {stats.ttft_seconds * 1000:.0f} "
        f"ms, acceptance {stats.acceptance_rate:.0%}, {stats.mean_accepted_len:.2f} tokens per target pass[/]"
    )
