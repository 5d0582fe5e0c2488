"""llama.cpp's own `llama-server` on the tuned pair: the command (flag names of the pinned llama.cpp), and a
supervised child process that is ready when its /health says so and never outlives spectune.

With `exact`, the settings that keep batched logits equal to one-token ones (README "Identical answers"):
`--no-repack`, flash attention off and GGML_CPU_TILED_MM=0, so the server's answers are the target's own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Literal

from spectune.engines.llama_cpp import defaults_env
from spectune.errors import SpectuneError
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import spec_type
from spectune.runtime.ngram import NGRAM, NgramSettings
from spectune.runtime.registry import Variant
from spectune.threads import ALL_LAYERS

READY_POLL_SECONDS = 0.2
STOP_SECONDS = 10.0
LOG_TAIL_CHARS = 2000
PR_SET_PDEATHSIG = 1  # linux/prctl.h
NgramType = Literal["ngram-simple", "ngram-mod"]  # llama.cpp's n-gram speculators spectune hands a lookup to
LLAMA_CPP_LOOKUPS = {NGRAM}  # spectune's model-free speculators llama.cpp has one of its own for


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def server_command(
    binary: str | Path,
    target: Path,
    draft: Path | None,
    decode: DecodeSettings,
    threads: int,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    n_ctx: int = 4096,
    slots: int = 1,
    model_name: str = "spectune",
    exact: bool = True,
    lookups: tuple[str, ...] = (),
    ngram: NgramSettings | None = None,
    draft_type: str | None = None,
    gpu_layers: int = ALL_LAYERS,
) -> list[str]:
    """`llama-server` serving `target` (with `draft` and/or n-gram lookup speculating, see speculation_flags), a
    request's defaults from `decode`. The API key is not here: it goes through LLAMA_API_KEY, out of `ps`."""
    command = [str(binary), "-m", str(target), "-a", model_name, "--host", host, "--port", str(port)]
    # -c is shared by the slots: each gets n_ctx as in spectune's own server.
    command += ["-c", str(n_ctx * slots), "-np", str(slots), *thread_flags(threads)]
    command += ["--jinja", "--metrics", "--no-webui", *gpu_flags(gpu_layers, draft is not None)]
    ngram_n = (ngram or NgramSettings()).min_n
    command += speculation_flags(
        draft, decode.k, threads, lookups, decode.draft_p_min, ngram_n=ngram_n, draft_type=draft_type
    )
    command += ["-n", str(decode.max_tokens), "--temp", str(decode.temperature), "--top-k", str(decode.top_k)]
    command += ["--top-p", str(decode.top_p)] + (["-s", str(decode.seed)] if decode.seed is not None else [])
    command += ["--ignore-eos"] if decode.ignore_eos else []
    return command + exact_flags(exact)


def gpu_flags(gpu_layers: int, draft: bool) -> list[str]:
    """The layers llama.cpp's tools offload, target and draft alike (-1: all; a CPU build ignores them)."""
    layers = "all" if gpu_layers == ALL_LAYERS else str(gpu_layers)
    return ["-ngl", layers, *(["-ngld", layers] if draft else [])]


def thread_flags(threads: int) -> list[str]:
    """The same threads for one-token decodes and batches, as spectune's own contexts use."""
    return ["-t", str(threads), "-tb", str(threads)]


def exact_flags(exact: bool) -> list[str]:
    """The flag half of the exact settings (runtime/llama.py; the other half is server_env's)."""
    return ["--no-repack", "-fa", "off"] if exact else []


def llama_cpp_runs(variant: Variant) -> bool:
    """Whether llama.cpp has a speculator for each of the variant's (n-gram lookup: its own n-gram speculator)."""
    return set(variant.lookups) <= LLAMA_CPP_LOOKUPS


def speculation_flags(
    draft: Path | None,
    draft_max: int,
    threads: int,
    lookups: tuple[str, ...] = (),
    p_min: float = 0.0,
    ngram_type: NgramType = "ngram-simple",
    ngram_n: int = NgramSettings().min_n,
    draft_type: str | None = None,
) -> list[str]:
    """llama.cpp's flags for speculating as spectune's loop does: its speculators for spectune's model-free
    `lookups`, in their order (a Variant's), then `draft` proposing up to `draft_max` tokens, greedy, stopping below
    `p_min` confidence (0: never early). n-gram lookup goes to llama.cpp's `ngram_type`. ngram-simple: the context's
    continuation after its last `ngram_n` tokens (its default n-gram of 12
    tokens is sized for code). ngram-mod: its hashed table of every context n-gram, matched on its own default
    length (24 tokens), proposing up to `draft_max` (its default floor of 48 proposed tokens would leave a short
    answer nothing). `draft_type`: the draft's kind, by default read from its GGUF (runtime/llama.py spec_type): a
    draft model, an EAGLE-3 head (it drafts from the target's layer inputs) or an MTP assistant (from its states and
    KV cache); given where the command names the file relative to another folder. Shared by
    llama-server and llama-speculative-simple."""
    missing = [lookup for lookup in lookups if lookup not in LLAMA_CPP_LOOKUPS]
    if missing:
        raise SpectuneError(f"llama.cpp has no speculator for {', '.join(missing)}: only spectune's own loop runs it")
    spec_types = [ngram_type for _ in lookups] + ([draft_type or spec_type(draft)] if draft is not None else [])
    flags = ["--spec-type", ",".join(spec_types), "--spec-draft-n-max", str(draft_max)] if spec_types else []
    if lookups and ngram_type == "ngram-simple":
        flags += ["--spec-ngram-simple-size-n", str(ngram_n), "--spec-ngram-simple-size-m", str(draft_max)]
    elif lookups:
        flags += ["--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", str(draft_max)]
    if draft is not None:
        flags += ["-md", str(draft), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min)]
        flags += ["-td", str(threads), "-tbd", str(threads)]
    return flags


def server_env(exact: bool, api_key: str | None) -> dict[str, str]:
    """The variables a llama.cpp tool needs on top of the caller's environment. The tiled matmul is set both ways:
    spectune's own process always has it off (runtime/llama.py), and a non-exact tool runs llama.cpp's default
    (on a CPU with AMX, with AMX refused: see defaults_env)."""
    env = {"GGML_CPU_TILED_MM": "1", **defaults_env()} if not exact else {"GGML_CPU_TILED_MM": "0"}
    return {**env, "LLAMA_API_KEY": api_key} if api_key else env


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends it SIGTERM when spectune dies, even by SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LlamaServer:
    """A running `llama-server`; a context manager that stops it (SIGTERM, then SIGKILL) on the way out. Its output
    goes to `log` (a file opened for reading too, "w+": errors quote its tail), else to the terminal."""

    def __init__(self, command: list[str], env: dict[str, str], url: str, log: IO[str] | None = None) -> None:
        self.command, self.url = command, url
        self.process = subprocess.Popen(
            command,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log is not None else None,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self.log = log

    def wait_ready(self, timeout: float) -> None:
        """Poll /health until the model is loaded; a child that exits or a timeout is an error (and is stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpectuneError(f"llama-server exited with {self.process.returncode}:{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(READY_POLL_SECONDS)
        self.stop()
        raise SpectuneError(f"llama-server was not ready within {timeout:.0f} s:{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log is None:
            return " (its output went to the terminal)"
        self.log.flush()
        self.log.seek(0)
        return "\n" + self.log.read()[-LOG_TAIL_CHARS:]

    def stop(self) -> int:
        """Ask it to finish (SIGTERM, as Ctrl-C would), kill it past STOP_SECONDS; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
