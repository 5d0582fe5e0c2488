"""llama.cpp's own speculative decoder (`llama-speculative-simple`) as a peer: same GGUFs, prompts and settings,
so spectune's loop is compared with llama.cpp's in one run (`spectune bench --peer llama.cpp`). The tool is built
by `spectune tools build-llama-cpp` (engines/llama_cpp.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from spectune.engines.llama_cpp import SPECULATIVE_TOOL as TOOL
from spectune.errors import SpectuneError

LOG_ATTEMPTS = 8


@dataclass
class PeerRun:
    text: str
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
    draft: Path,
    prompt: str,
    draft_tokens: int,
    max_tokens: int,
    threads: int,
    n_ctx: int,
    exact: bool,
) -> PeerRun:
    """One greedy speculative generation by llama.cpp; its own timings (decode only, prompt excluded)."""
    command = [
        str(binary),
        *("-m", str(target), "-md", str(draft), "--spec-type", "draft-simple"),
        *("-p", prompt, "-n", str(max_tokens), "-c", str(n_ctx), "--temp", "0", "--top-k", "1"),
        *("--spec-draft-n-max", str(draft_tokens), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"),
        *("-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads)),
        *(("--no-repack", "-fa", "off") if exact else ()),
    ]
    env = {**os.environ, **({"GGML_CPU_TILED_MM": "0"} if exact else {})}
    # llama.cpp's logger is an unflushed background queue, so its closing stats are lost at exit about half the
    # time (upstream issue 22142): run again until they come through.
    for _attempt in range(LOG_ATTEMPTS):
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        log = result.stdout + result.stderr
        if result.returncode != 0:
            raise SpectuneError(f"{TOOL} failed (exit {result.returncode}):\n{log[-1500:]}")
        if "n_accept" in log:
            break
    return PeerRun(
        text=result.stdout,
        decoded_tokens=int(_field(r"decoded\s+(\d+) tokens", log)),
        seconds=float(_field(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log)),
        drafted=int(_field(r"n_drafted\s*=\s*(\d+)", log)),
        accepted=int(_field(r"n_accept\s*=\s*(\d+)", log)),
    )
