"""llama.cpp's own decoding beside ours, on the same GGUFs, prompts and settings (`spectune bench --peer`): its
speculative decoder (`llama-speculative-simple`) on each pair, and the target alone through `llama-server`, the
baseline every speedup is measured against. Both are built by `spectune tools build-llama-cpp`.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from spectune.engines.llama_cpp import SERVER, built_tool
from spectune.engines.llama_cpp import SPECULATIVE_TOOL as TOOL
from spectune.engines.llama_server import (
    LlamaServer,
    NgramType,
    exact_flags,
    free_port,
    gpu_flags,
    server_command,
    server_env,
    speculation_flags,
    thread_flags,
)
from spectune.errors import SpectuneError
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.ngram import NgramSettings
from spectune.threads import ALL_LAYERS

LOG_ATTEMPTS = 8
BASELINE_READY_SECONDS = 120.0


@dataclass
class PeerRun:
    text: str | None  # exactly the generated text (None: the tool's output was not laid out as expected)
    decoded_tokens: int
    seconds: float
    drafted: int
    accepted: int

    @property
    def tokens_per_second(self) -> float:
        return self.decoded_tokens / self.seconds if self.seconds > 0 else 0.0


def _field(pattern: str, log: str) -> str:
    match = re.search(pattern, log)
    if match is None:
        raise SpectuneError(f"{TOOL}: could not find {pattern!r} in its output:\n{log[-1500:]}")
    return match.group(1)


def run_peer(
    binary: Path,
    target: Path,
    draft: Path | None,
    prompt: str,
    draft_tokens: int,
    max_tokens: int,
    threads: int,
    n_ctx: int,
    exact: bool,
    lookups: tuple[str, ...] = (),
    ngram_type: NgramType = "ngram-simple",
    ngram_n: int = NgramSettings().min_n,
) -> PeerRun:
    """One greedy speculative generation by llama.cpp, with a draft model and/or its own speculators for
    spectune's `lookups` in front (n-gram lookup: `ngram_type`; the draft a model, an EAGLE-3 head or an MTP
    assistant); its own timings (decode only, prompt excluded)."""
    speculation = speculation_flags(draft, draft_tokens, threads, lookups, ngram_type=ngram_type, ngram_n=ngram_n)
    command = [
        *(str(binary), "-m", str(target), *speculation),
        *("-p", prompt, "-n", str(max_tokens), "-c", str(n_ctx), "--temp", "0", "--top-k", "1"),
        *thread_flags(threads),
        *gpu_flags(ALL_LAYERS, draft is not None),  # every layer on the GPU where the tool is built for one
        *exact_flags(exact),
    ]
    env = {**os.environ, **server_env(exact, None)}
    # llama.cpp's logger is an unflushed background queue, so its closing stats are lost at exit about half the
    # time (upstream issue 22142): run again until they come through.
    for _attempt in range(LOG_ATTEMPTS):
        # errors="replace": a small model may stop inside a character's UTF-8 bytes
        result = subprocess.run(command, capture_output=True, text=True, errors="replace", env=env)
        log = result.stdout + result.stderr
        if result.returncode != 0:
            raise SpectuneError(f"{TOOL} failed (exit {result.returncode}):\n{log[-1500:]}")
        if "n_accept" in log:
            break
    return PeerRun(
        text=generated_text(result.stdout, prompt),
        decoded_tokens=int(_field(r"decoded\s+(\d+) tokens", log)),
        seconds=float(_field(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log)),
        drafted=int(_field(r"n_drafted\s*=\s*(\d+)", log)),
        accepted=int(_field(r"n_accept\s*=\s*(\d+)", log)),
    )


# llama-speculative-simple's standard output: "\n\n", the prompt as it read it (a BOS it adds printed before it),
# the generated text (no end token), "\n\n" after decoding, and "\n\n" at exit, which its logger loses about half
# the time (the run is retried until the statistics, logged after the first closing, came through).
CLOSING = "\n\n"


def generated_text(stdout: str, prompt: str) -> str | None:
    """What the tool generated, cut exactly from its standard output; None when it is not laid out as above. An
    answer that itself ends in a blank line, with the exit's closing lost, loses that line here: a difference
    reported where there may be none, never the other way round."""
    start = stdout.find(prompt)
    if start < 0 or not stdout.endswith(CLOSING):
        return None
    text = stdout[start + len(prompt) : len(stdout) - len(CLOSING)]
    return text.removesuffix(CLOSING)


@contextmanager
def llama_baseline(
    target: Path, threads: int, n_ctx: int, exact: bool, binary: Path | None = None
) -> Iterator[Callable[[str, int], PeerRun]]:
    """The target alone decoded by llama.cpp's own loop (`llama-server`, no draft, the same GGUF, threads and exact
    settings): the baseline our target-alone loop is checked against. Yields run(prompt text, max tokens); its
    timings are the server's own decode time, the prompt excluded, as ours are."""
    port = free_port()
    command = server_command(
        binary or built_tool(SERVER),
        target,
        None,
        DecodeSettings(draft_max=0),
        threads,
        port=port,
        n_ctx=n_ctx,
        exact=exact,
    )
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log, LlamaServer(command, server_env(exact, None), url, log) as server:
        server.wait_ready(BASELINE_READY_SECONDS)

        def run(prompt: str, max_tokens: int) -> PeerRun:
            body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False}
            reply = httpx.post(f"{server.url}/completion", json=body, timeout=600).raise_for_status().json()
            timings = reply["timings"]
            return PeerRun(reply["content"], timings["predicted_n"], timings["predicted_ms"] / 1000, 0, 0)

        yield run
