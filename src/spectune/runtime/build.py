"""Which llama.cpp build this process runs, and whether it can promise identical greedy answers for a GGUF.

Greedy speculative decoding gives the target's own answer only if verifying k+1 tokens in one batch yields the
same logits, bit for bit, as decoding them one at a time. On the CPU backend three things break that, each found
by measurement (see README "Identical answers"):

- weight repacking and the tiled K-quant kernels: `exact` turns them off at run time (no extra buffer types,
  GGML_CPU_TILED_MM=0), and flash attention;
- llamafile's tinyBLAS, compiled in by default (GGML_LLAMAFILE): ggml sends every product of two or more rows
  whose weights are F32, F16, BF16, Q8_0, Q4_0, Q5_0 or IQ4_NL to it, and one-row products (plain decoding) to
  the vec_dot kernels, which sum in another order. It also takes batched attention over the F16 KV cache. There
  is no run-time switch (ggml-cpu.c, `llamafile_sgemm`), so spectune's install builds llama.cpp without it.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

from spectune.errors import SpectuneError

# Weight types that ggml-cpu hands to llamafile_sgemm on x86 when two or more rows are multiplied.
LLAMAFILE_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL"})
GPU_BACKENDS = frozenset({"CUDA", "Metal", "Vulkan", "ROCm", "HIP", "SYCL"})


@functools.cache  # the library a process loaded does not change under it
def build_features() -> dict[str, str]:
    """llama.cpp's compile-time features as it reports them (e.g. {"AVX2": "1", "LLAMAFILE": "1"})."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    features = {}
    for part in info.replace("\n", "|").split("|"):  # "CPU : SSE3 = 1 | AVX2 = 1 | ... | CUDA : ARCHS = 890 | ..."
        backend, colon, rest = part.rpartition(":")
        if colon:
            features[backend.strip()] = "1"  # a backend compiled in
        key, equals, value = rest.rpartition("=")
        if equals:
            features[key.strip()] = value.strip()
    return features


def llamafile_compiled() -> bool:
    return build_features().get("LLAMAFILE") == "1"


def gpu_offload() -> bool:
    """Whether this llama.cpp build can run layers on a GPU (a CUDA build: `make install` on a machine with one)."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def torch_device() -> str:
    """Where training runs: the CUDA card torch sees, else the CPU."""
    import torch

    return f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cpu"


def build_name() -> str:
    """The binding and how it was built, as answers and reports name it."""
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}, llamafile {'on' if llamafile_compiled() else 'off'}"


def read_gguf(path: str | Path) -> Any:
    """The gguf library's reader of a file, or an error that names the file (the reader's own errors say nothing a
    user can act on: "cannot reshape array", a bare IndexError)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError) as exc:  # what the reader raises on a corrupt or empty file
        raise SpectuneError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def gguf_field(path: str | Path, key: str) -> Any:
    """A metadata field's value (a string, a number, a list), None when the GGUF has no such field."""
    field = read_gguf(path).fields.get(key)
    return None if field is None else field.contents()


def matrix_types(gguf: str | Path) -> Counter[str]:
    """How many weight matrices (2-D tensors) the GGUF stores in each type."""
    tensors = read_gguf(gguf).tensors
    return Counter(t.tensor_type.name for t in tensors if len(t.shape) >= 2)


def identity_verdict(gguf: str | Path, exact: bool) -> dict[str, Any]:
    """Whether this build, with `exact` as set, gives batched logits equal to one-token logits for this GGUF."""
    types = matrix_types(gguf)
    reasons = []
    if not exact:
        reasons.append("exact is off: repacked weights, tiled K-quant kernels and flash attention batch differently")
    if llamafile_compiled():
        batched = {name: count for name, count in sorted(types.items()) if name in LLAMAFILE_TYPES}
        named = ", ".join(f"{count} {name}" for name, count in batched.items()) or "no weight matrices"
        reasons.append(
            f"this llama.cpp has llamafile compiled in: batched products of {named} and of the F16 KV cache round "
            "differently from one-token decoding; rebuild it without: `rm .venv/.installed; make install`"
        )
    gpu_backends = sorted(GPU_BACKENDS & build_features().keys())
    if gpu_backends:
        reasons.append(
            f"{', '.join(gpu_backends)} compiled in: its batched and one-token matmul kernels differ; identity is "
            "measured (spectune doctor), not guaranteed"
        )
    return {
        "gguf": str(gguf),
        "build": build_name(),
        "exact": exact,
        "guaranteed": not reasons,
        "reasons": reasons,
        "matrix_types": dict(sorted(types.items())),
    }
