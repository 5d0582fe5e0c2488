"""An importance matrix from the run's own dialogues, for quantizing each model toward what it will say.

A K-quant rounds each block of weights to minimise its error; with an importance matrix (`llama-imatrix`: the mean
squared activation each weight column sees on calibration text) it minimises the error weighted by how much each
column matters on that text, which is what the quantizers people download (bartowski's, Unsloth's) do on chat data.
spectune's calibration text is the run's own training dialogues rendered with the model's chat template, so the
columns that matter for this task keep their precision. Both steps are llama.cpp's own tools built from the pinned
sources (`spectune tools build-llama-cpp`); libllama's quantize API cannot take the matrix from Python.

The matrix is cached by content (the F16 GGUF's and the text's digests), so a rerun or a second quant type of the
same model computes it once.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any

from spectune.atomic import atomic_path
from spectune.cache import cache_root, path_hash
from spectune.engines.llama_cpp import IMATRIX_TOOL, QUANTIZE_TOOL, built_tool, run_tool
from spectune.engines.llama_server import thread_flags
from spectune.errors import SpectuneError
from spectune.threads import thread_count

CHUNK_TOKENS = 512  # llama-imatrix's context per chunk
# 16k tokens: on SmolLM2 128 chunks gave the same fidelity at 4x the time (imatrix_sgd*.json, in git at fac0e59)
MAX_CHUNKS = 32
IMATRIX_TYPES = ("Q4_0", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K")  # the types quantized with it (Q8_0 and up ignore it)


def cached_matrix(f16_gguf: Path, text: str, max_chunks: int = MAX_CHUNKS) -> Path:
    """Where the matrix of `f16_gguf` on `text` is cached: named by the F16's and the text's digests."""
    key = hashlib.sha256(f"{path_hash(f16_gguf)}\n{CHUNK_TOKENS}\n{max_chunks}\n{text}".encode()).hexdigest()[:24]
    return cache_root() / "imatrix" / f"{key}.gguf"


def importance_matrix(
    f16_gguf: Path, text: str, threads: int | None = None, max_chunks: int = MAX_CHUNKS
) -> tuple[Path, dict[str, Any]]:
    """The importance matrix of `f16_gguf` on `text` (at most `max_chunks` chunks of it; cached), and what it was
    made of: its chunks and the seconds it took (0 from the cache)."""
    if not text.strip():
        raise SpectuneError(f"{f16_gguf}: no calibration text for its importance matrix")
    out = cached_matrix(f16_gguf, text, max_chunks)
    info = {"file": str(out), "chunk_tokens": CHUNK_TOKENS, "max_chunks": max_chunks, "seconds": 0.0}
    if out.is_file():
        return out, info
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, atomic_path(out) as tmp:
        text_file = Path(scratch) / "calibration.txt"
        text_file.write_text(text)
        command = [str(built_tool(IMATRIX_TOOL)), "-m", str(f16_gguf), "-f", str(text_file), "-o", str(tmp)]
        command += ["-c", str(CHUNK_TOKENS), "--chunks", str(max_chunks), "--no-ppl", "--parse-special"]
        run_tool([*command, *thread_flags(thread_count(threads))], "llama-imatrix")
        if not tmp.is_file():
            raise SpectuneError(f"llama-imatrix wrote no matrix for {f16_gguf} (calibration text too short?)")
    return out, info | {"seconds": round(time.perf_counter() - start, 1)}


def quantize_with(f16_gguf: Path, out_file: Path, quant: str, imatrix: Path, threads: int | None = None) -> Path:
    """`llama-quantize --imatrix`: the same quantization as libllama's, weighted by the matrix (atomic)."""
    with atomic_path(out_file) as tmp:
        command = [str(built_tool(QUANTIZE_TOOL)), "--imatrix", str(imatrix), str(f16_gguf), str(tmp), quant]
        run_tool([*command, str(thread_count(threads))], "llama-quantize")
    return out_file
