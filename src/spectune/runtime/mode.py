"""Which way to decode on this machine: speculative at the exact settings, or the target alone at llama.cpp's
fastest settings.

Speculative answers equal the target's own only at the exact settings (no repacked weights, no flash attention:
runtime/llama.py), which cost 8-38% a token on a CPU. Where no draft wins that back, the target alone at llama.cpp's
fastest settings (repacked weights, flash attention as llama.cpp chooses) answers sooner, and what it says is the
target's own answer by construction: nothing speculates. So `auto` measures both on a few prompts at start and
serves the faster; `speculative` and `fastest` force one. The tiled K-quant matmul (process-wide, read at the first
batched matmul: runtime/llama.py) is on only in a process that decodes at the fastest settings alone; so `spectune
serve --mode auto` measures in a process of its own (`settle_auto`), and one that chose the fastest mode prefills as
llama.cpp's own tools do (the tiled matmul touches batched prefill only, not the one-token decode compared here).

The two modes answer as two different "targets alone": the fastest kernels round logits otherwise and, where two
tokens are close, pick another (measured: 5 of 226 demo answers differ at Q4_K_M, 39 of 60 SGD answers for SmolLM2
at Q4_1; docs/serving.md). So what `auto` chose is recorded (the user cache, keyed by the pair's files, the build,
the machine and the settings) and served again at every later start: a noisy timing decides once, and the same
request to the same server gets the same answer after a restart. `--recalibrate` measures again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import platform
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from spectune.atomic import atomic_path
from spectune.cache import cache_root
from spectune.config import Settings
from spectune.runtime.build import build_name
from spectune.runtime.chat import chat_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DRAFT
from spectune.runtime.llama import LlamaModel
from spectune.runtime.registry import Variant
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.threads import ALL_LAYERS

Mode = Literal["auto", "speculative", "fastest"]
Chosen = Literal["speculative", "fastest"]
CALIBRATION_TOKENS = 32  # per prompt and round: enough steps for the draft's acceptance to show
CALIBRATION_ROUNDS = 2  # measured rounds after a short warm-up; the quicker round counts (a stall only slows)
# What only a speculating decoder reads: `--mode fastest` (the target alone) refuses them rather than drop them.
SPECULATION_SETTINGS = frozenset({"draft_max", "adaptive", "first_words", "ngram", "ngram_data", "speculators"})
# A phone assistant's first questions, where no task data is given (--calibration-data, or a run's eval set).
CALIBRATION_PROMPTS = (
    "Hi, I'd like to book a table for two tomorrow evening. What times do you have?",
    "Can you tell me when my order will arrive? It was placed on Monday.",
    "I need to change my flight to Friday morning, is that possible?",
)


class ModeSettings(Settings):
    """How `spectune serve` and `generate` pick their way of decoding (the one definition of these settings)."""

    mode: Mode = Field(
        "auto",
        description="speculative: target + draft at the exact settings (answers identical to the target alone's at "
        "those settings; with no draft, that target alone); fastest: the target alone at llama.cpp's fastest "
        "settings; auto: whichever decodes faster here, measured at the first start and recorded for the next "
        "(the target alone is always fastest).",
    )
    recalibrate: bool = Field(
        False, description="--mode auto: measure again rather than serve the choice recorded for this pair here."
    )

    @model_validator(mode="before")
    @classmethod
    def _nothing_dropped_when_fastest(cls, values: Any) -> Any:
        """What the user gave (flags, YAML), before a run's pair fills anything in."""
        if isinstance(values, dict) and values.get("mode") == "fastest":
            given = sorted(name for name in SPECULATION_SETTINGS if values.get(name) not in (None, []))  # {}: on
            if given:
                raise ValueError(
                    f"{', '.join(given)}: speculation settings, unused by --mode fastest (the target alone); leave "
                    "them out, or use --mode speculative or auto"
                )
        return values

    calibration_data: Path | None = Field(
        None,
        description="Chat dataset whose first prompts --mode auto measures (default: a run's eval set, else three "
        "built-in phone questions).",
    )


@dataclass(frozen=True)
class ModeChoice:
    mode: Chosen
    reason: str
    # Measured decode speeds (tokens after the first over their seconds), where auto measured them.
    speculative_tokens_per_second: float | None = None
    fastest_tokens_per_second: float | None = None


def answer_class(mode: Chosen, exact: bool) -> str:
    """Which "target alone" a decoder's answers equal (system_fingerprint says it): the exact settings' or the
    fastest's; speculation with exact off promises neither."""
    if mode == "fastest":
        return "answers=target-alone-fastest"
    return "answers=target-alone-exact" if exact else "answers=not-guaranteed"


def faster(speculative_tokens_per_second: float, fastest_tokens_per_second: float) -> Chosen:
    """The rule serve, generate and bench share: speculate only where it decodes faster than the fastest alone."""
    return "speculative" if speculative_tokens_per_second > fastest_tokens_per_second else "fastest"


@dataclass(frozen=True)
class DecoderSource:
    """What a decoder is loaded from, in either mode (each load is its own contexts: a server slot's)."""

    target: Path
    draft: Path | None
    n_ctx: int
    threads: int | None
    exact: bool  # the speculative mode's setting (fastest is never exact)
    lookups: tuple[str, ...] = ()  # model-free speculators in front of the draft, in order (runtime/registry.py)
    setups: dict[str, Any] = field(default_factory=dict)  # what the verb gave each of them (n-gram: NgramSetup)
    gpu_layers: int = ALL_LAYERS  # offloaded to the GPU, where llama.cpp is built for one

    @property
    def speculates(self) -> bool:
        return self.draft is not None or bool(self.lookups)

    def load(self, mode: Chosen) -> SpeculativeDecoder:
        loading = {"n_ctx": self.n_ctx, "threads": self.threads, "gpu_layers": self.gpu_layers}
        if mode == "fastest":
            return SpeculativeDecoder(LlamaModel(self.target, exact=False, **loading))
        target = LlamaModel(self.target, exact=self.exact, **loading)
        draft = None
        if self.draft:  # a head runs beside its target; any other draft ignores `beside`
            draft = LlamaModel(self.draft, exact=self.exact, beside=target, **loading)
        variant = Variant(self.lookups, DRAFT if draft else None)
        return SpeculativeDecoder(target, variant.speculators(target, draft, self.setups))


def choose(
    requested: Mode,
    source: DecoderSource,
    conversations: list[list[dict[str, str]]],
    decoding: DecodeSettings,
    log: Callable[[str], None] = lambda _: None,
    recalibrate: bool = False,
) -> tuple[ModeChoice, SpeculativeDecoder]:
    """The mode to decode in, and a decoder loaded in it. auto serves what it recorded for this pair here, else
    measures both on `conversations` (the loser's models are freed) and records the choice; the target alone, with
    no draft nor lookup, is the fastest mode with nothing to measure unless the exact settings are asked for."""
    if not source.speculates and requested == "speculative":
        choice = ModeChoice("speculative", "--mode speculative, no draft nor lookup: the target alone, exact settings")
    elif not source.speculates:
        choice = ModeChoice("fastest", "no draft nor lookup: the target alone, at llama.cpp's fastest settings")
    elif requested != "auto":
        choice = ModeChoice(requested, f"--mode {requested}")
    else:
        record = recorded_choice_file(source, conversations, decoding)
        recorded = None if recalibrate else read_recorded(record)
        if recorded is None:
            return measure_and_record(source, conversations, decoding, record, log)
        choice = recorded
    log(f"mode {choice.mode} ({choice.reason})")
    return choice, source.load(choice.mode)


def measure_and_record(
    source: DecoderSource,
    conversations: list[list[dict[str, str]]],
    decoding: DecodeSettings,
    record: Path,
    log: Callable[[str], None],
) -> tuple[ModeChoice, SpeculativeDecoder]:
    """auto's first start: both modes loaded and measured, the loser freed, the choice recorded for the next."""
    decoders = {mode: source.load(mode) for mode in ("speculative", "fastest")}
    # On a thread of its own that then ends: llama.cpp's OpenMP build keeps a team of worker threads per calling
    # thread, and a team left on this thread outnumbered the cores beside each request thread's own, so OpenMP
    # spun less at its barriers: the Qwen 1.5B was served at 26-30 tok/s after it, 37-41 without.
    with ThreadPoolExecutor(max_workers=1) as pool:
        choice = pool.submit(calibrate, decoders["speculative"], decoders["fastest"], conversations, decoding).result()
    close(decoders.pop("fastest" if choice.mode == "speculative" else "speculative"))
    write_recorded(record, choice)
    log(f"mode auto -> {choice.mode} ({choice.reason})")
    return choice, decoders[choice.mode]


def settle_auto(
    source: DecoderSource, conversations: list[list[dict[str, str]]], decoding: DecodeSettings, recalibrate: bool
) -> ModeChoice:
    """auto's choice for this pair: the recorded one, else measured and recorded in a process of its own (spawned:
    a fresh llama.cpp), so that this process has decoded nothing when it loads the chosen mode, and the fastest mode
    gets the tiled matmul (`use_tiled_matmul`). `choose` then serves the recorded choice."""
    record = recorded_choice_file(source, conversations, decoding)
    recorded = None if recalibrate else read_recorded(record)
    if recorded is not None:
        return recorded
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
        choice = child.submit(_measure_both, source, conversations, decoding, record).result()
    return choice


def _measure_both(
    source: DecoderSource, conversations: list[list[dict[str, str]]], decoding: DecodeSettings, record: Path
) -> ModeChoice:
    choice, decoder = measure_and_record(source, conversations, decoding, record, lambda _: None)
    close(decoder)
    return choice


def close(decoder: SpeculativeDecoder) -> None:
    """Free a decoder's models now (not at the garbage collector's leisure: a repacked target is a copy)."""
    for model in decoder.models:
        model.close()


def calibrate(
    speculative: SpeculativeDecoder,
    fastest: SpeculativeDecoder,
    conversations: list[list[dict[str, str]]],
    decoding: DecodeSettings,
) -> ModeChoice:
    """Decode each conversation both ways, interleaved, and choose by the quicker round of each (after a short
    warm-up). Both decoders forget between answers: the first token is a prefill either way and is not counted."""
    settings = decoding.model_copy(update={"max_tokens": CALIBRATION_TOKENS})
    prompts = [chat_tokens(speculative.target, messages) for messages in conversations]
    decoders = {"speculative": speculative, "fastest": fastest}
    for decoder in decoders.values():  # warm-up: page faults, the threads' first wake
        decoder.forget()
        decoder.generate(prompts[0], settings.model_copy(update={"max_tokens": 4}))
    best: dict[str, float] = {}
    for _ in range(CALIBRATION_ROUNDS):
        for name, decoder in decoders.items():
            tokens, seconds = 0, 0.0
            for prompt in prompts:
                decoder.forget()
                stats = decoder.generate(prompt, settings).stats
                tokens += max(0, stats.generated - 1)
                seconds += stats.total_seconds - stats.ttft_seconds
            rate = tokens / seconds if seconds > 0 else 0.0
            best[name] = max(best.get(name, 0.0), rate)
    for decoder in decoders.values():
        decoder.forget()
    chosen = faster(best["speculative"], best["fastest"])
    reason = (
        f"measured here on {len(prompts)} prompts: speculative {best['speculative']:.1f} tok/s, the target alone at "
        f"llama.cpp's fastest settings {best['fastest']:.1f} tok/s"
    )
    return ModeChoice(chosen, reason, best["speculative"], best["fastest"])


def _file_identity(path: Path | None) -> list[Any] | None:
    if path is None:
        return None
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def machine_name() -> str:
    """The CPU's model name where the system says it, else its architecture: a choice measured on one machine is not
    another's."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.machine()


def recorded_choice_file(
    source: DecoderSource, conversations: list[list[dict[str, str]]], decoding: DecodeSettings
) -> Path:
    """Where auto's choice for this pair, build, machine and settings is recorded."""
    key = {
        "target": _file_identity(source.target),
        "draft": _file_identity(source.draft),
        "lookups": list(source.lookups),
        "n_ctx": source.n_ctx,
        "threads": source.threads,
        "exact": source.exact,
        "build": build_name(),
        "machine": machine_name(),
        "prompts": conversations,
        "decoding": decoding.model_dump(mode="json"),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_root() / "modes" / f"{digest}.json"


def read_recorded(path: Path) -> ModeChoice | None:
    """A recorded choice, or None where there is none (or it cannot be read: then it is measured again)."""
    try:
        loaded = json.loads(path.read_text())
        choice = ModeChoice(**loaded["choice"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if choice.mode not in ("speculative", "fastest"):
        return None
    reason = f"{choice.reason}; recorded {loaded.get('recorded', '?')} and served again (--recalibrate measures anew)"
    return dataclasses.replace(choice, reason=reason)


def write_recorded(path: Path, choice: ModeChoice) -> None:
    recorded = {"recorded": time.strftime("%Y-%m-%d %H:%M"), "choice": dataclasses.asdict(choice)}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(recorded, indent=2))
