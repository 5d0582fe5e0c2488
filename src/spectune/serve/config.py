"""`spectune serve`'s settings: the one definition of what the server takes (flags, YAML, a run's chosen pair)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from spectune.layout import RunLayout
from spectune.runtime.chosen import ChosenPair
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.first_words import FirstWords
from spectune.runtime.mode import ModeSettings
from spectune.runtime.ngram import NgramSettings
from spectune.runtime.registry import SpeculatorSettings
from spectune.threads import LlamaSettings

# What llama-server has no equivalent for (its request size, queue, time and connection limits are its own).
SPECTUNE_ONLY = {
    "queue_timeout",
    "max_request_bytes",
    "max_seconds",
    "reuse_prefix",
    "prefix_cache_mib",  # llama-server's own is --cache-ram
    "limit_concurrency",
    "max_connections",
    "header_timeout",
    "body_timeout",
    "keep_alive",
    "first_words",
    "ngram_data",  # llama-server's n-gram speculator reads the conversation only
    "speculators",  # llama-server has its own list (--spec-type): n-gram lookup is handed to it by --ngram
    "stop",  # a request's own stop strings reach llama-server; it has no server-wide default
    "min_tokens",
    "adaptive",
    "mode",  # llama-server decodes as its flags say: spectune serve --mode fastest is llama-server without a draft
    "calibration_data",
}


class ServeConfig(DecodeSettings, ModeSettings, LlamaSettings, SpeculatorSettings):
    """Everything `spectune serve` takes; the decoding settings are the defaults of a request that names none
    (as llama-server's -n, --temp, --top-k, ...)."""

    engine: Literal["spectune", "llama.cpp"] = Field(
        "spectune", description="spectune's own server, or llama.cpp's llama-server on the same pair and settings."
    )
    llama_server: Path | None = Field(
        None, description="The llama-server binary for --engine llama.cpp (default: `spectune tools build-llama-cpp`)."
    )
    target: Path | None = Field(None, description="Target GGUF (or --run).")
    draft: Path | None = Field(None, description="Draft GGUF: speculative decoding (or --run).")
    run: Path | None = Field(None, description="A finished `spectune run` folder: serve its chosen pair and k.")
    host: str = Field("127.0.0.1", description="Bind address (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="Port.")
    slots: int = Field(
        1, ge=1, le=256, description="Concurrent generations (each its own contexts; refused past the memory left)."
    )
    queue_timeout: float = Field(30.0, gt=0, description="Seconds a request may wait for a slot, then 503.")
    api_key: str | None = Field(
        None,
        min_length=1,
        description="Require this bearer token (also $SPECTUNE_API_KEY); several comma-separated, each key its own "
        "tenant (no cached prompt is shared between tenants).",
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest request body (413 past it).")
    max_seconds: float = Field(120.0, gt=0, description="Longest a generation may run (then finish_reason length).")
    model_name: str = Field("spectune", description="The model id the API reports.")
    reuse_prefix: bool = Field(
        True,
        description="Reuse cached prompt prefixes: a caller's conversation (its `user`) for its next turn, and the "
        "leading system messages for every caller of the same tenant and cache_salt.",
    )
    prefix_cache_mib: int = Field(
        1024, ge=0, description="Host memory for saved prompt prefixes (system prompts, conversations), LRU."
    )
    first_words: FirstWords = Field(
        "auto",
        description="The first clause: drafted from the second token on (draft), by the target alone while the draft "
        "catches up (alone), or whichever this server has measured to come sooner (auto). The first token is "
        "always the target's own.",
    )
    limit_concurrency: int = Field(
        64, ge=1, description="Requests waiting for or holding a slot at most; 503 past it (/health never waits)."
    )
    max_connections: int = Field(
        1024, ge=2, description="Open connections at most; past it a new one closes the oldest that holds no request."
    )
    header_timeout: float = Field(
        10.0, gt=0, description="Seconds a connection may take to send a request's headers (half-open, slowloris)."
    )
    body_timeout: float = Field(10.0, gt=0, description="Seconds a request's body may take after its headers (408).")
    keep_alive: float = Field(5.0, gt=0, description="Seconds an idle keep-alive connection stays open.")
    ngram: NgramSettings | None = Field(
        None, description="N-gram lookup in front of the draft (or alone): the conversation's, and the domain's."
    )
    ngram_data: Path | None = Field(
        None, description="Chat dataset whose assistant turns fill the n-gram domain table (the target's answers)."
    )

    @property
    def fastest_only(self) -> bool:
        """Whether this server decodes only at the fastest settings, with nothing to measure first (runtime/mode.py:
        --mode fastest, or the target alone)."""
        alone = self.draft is None and not self.lookups(self.ngram is not None)
        return self.mode == "fastest" or (alone and self.mode == "auto")

    @model_validator(mode="after")
    def _fill_from_run(self) -> ServeConfig:
        own = sorted(SPECTUNE_ONLY & self.model_fields_set)
        if self.engine == "llama.cpp" and own:
            raise ValueError(f"{', '.join(own)}: settings of spectune's own server, not of --engine llama.cpp")
        recommended_k = None
        if self.run is not None:  # the run's chosen pair, where the flags do not say otherwise
            layout = RunLayout(self.run)
            chosen = ChosenPair.read(layout.chosen_pair)
            self.target = self.target or chosen.target
            self.draft = self.draft or chosen.draft
            recommended_k = chosen.k
            self.calibration_data = self.calibration_data or (layout.eval_file if layout.eval_file.is_file() else None)
            if "ngram" not in self.model_fields_set and chosen.ngram is not None:
                self.ngram = chosen.ngram
                # llama-server's n-gram speculator reads the conversation only
                use_data = self.engine == "spectune" and not self.ngram_data
                self.ngram_data = chosen.ngram_data if use_data else self.ngram_data
        if self.target is None:
            raise ValueError("give --target (and --draft), or --run RUN_DIR")
        if self.ngram_data is not None and self.ngram is None:
            raise ValueError("--ngram-data fills n-gram lookup's domain table: give --ngram too (e.g. --ngram on)")
        self.draft_max = self.with_k(recommended_k).k  # auto: the run's measured k, else the default
        return self
