"""Which llama.cpp build this machine gets: CUDA for the NVIDIA card it finds (and a CUDA toolkit to build with),
else the CPU build; `GPU=cuda|cpu` forces either way, `CUDA_ARCH` names the card's compute capability.

Standard library only: `make install` runs it before anything is installed, and `spectune tools build-llama-cpp`
builds llama.cpp's own tools with the same choice, so the binding and the tools run the same kernels.

    python -m spectune.accelerator [--gpu auto|cuda|cpu] [--cuda-arch 89] [--llamafile OFF] [--describe]

prints the cmake arguments (or, with --describe, the one line the install log and the console say).
"""

from __future__ import annotations

import argparse
import ctypes.util
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHOICES = ("auto", "cuda", "cpu")
STORY_CARD_ARCH = "89"  # an RTX 4060 Ti 16GB (Ada, compute capability 8.9): where no card says its own


@dataclass(frozen=True)
class Backend:
    name: str  # cpu | cuda
    arch: str | None  # CUDA architecture for cmake (compute capability without the dot)
    why: str

    def cmake_args(self, llamafile: str = "OFF") -> list[str]:
        """llama.cpp's cmake arguments for this backend; llamafile's tinyBLAS off by default (identical answers)."""
        args = [f"-DGGML_LLAMAFILE={llamafile}"]
        if self.name == "cuda":
            args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={self.arch}"]
        return args

    def describe(self) -> str:
        build = f"CUDA build for compute capability {self.arch}" if self.name == "cuda" else "CPU build"
        return f"llama.cpp: {build} ({self.why})"


def card_arch(which: Callable[[str], str | None], run: Callable[..., subprocess.CompletedProcess]) -> str | None:
    """The first NVIDIA card's compute capability as cmake writes it ("8.9" -> "89"); None without a card."""
    if which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    try:
        result = run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = result.stdout.split() if result.returncode == 0 else []
    return lines[0].replace(".", "") if lines and lines[0].replace(".", "").isdigit() else None


def toolkit_lacks(nvcc: str) -> list[str]:
    """What llama.cpp's CUDA build links that the toolkit `nvcc` belongs to lacks: cuBLAS, and the driver library
    (libcuda: the toolkit's stubs, or the NVIDIA driver's own). A toolkit installed without them, as this project's
    CPU machines have, stops that build at cmake (CUDA::cublas, CUDA::cuda_driver not found)."""
    root = Path(nvcc).resolve().parent.parent

    def found(name: str, *folders: str) -> bool:
        return any(any(root.glob(f"{folder}/{name}*")) for folder in folders)

    lacks = [] if found("libcublas.so", "lib64", "lib", "targets/*/lib") else ["cuBLAS"]
    driver = found("libcuda.so", "lib64/stubs", "lib/stubs", "targets/*/lib/stubs") or ctypes.util.find_library("cuda")
    return lacks + ([] if driver else ["libcuda (the driver library or the toolkit's stubs)"])


def choose(
    gpu: str = "auto",
    cuda_arch: str | None = None,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> Backend:
    """The build for `gpu` (auto: CUDA where an NVIDIA card and a CUDA toolkit are both here)."""
    if gpu not in CHOICES:
        raise ValueError(f"GPU={gpu!r}: choose one of {', '.join(CHOICES)}")
    if gpu == "cpu":
        return Backend("cpu", None, "GPU=cpu")
    nvcc = which("nvcc")
    lacks = toolkit_lacks(nvcc) if nvcc is not None else []
    toolkit = nvcc is not None and not lacks
    found = card_arch(which, run)
    missing = (
        "no CUDA toolkit (nvcc not on PATH)"
        if nvcc is None
        else f"the CUDA toolkit of {nvcc} has no {' nor '.join(lacks)}"
    )
    if gpu == "cuda":
        if not toolkit:
            raise ValueError(
                f"GPU=cuda: {missing}, which llama.cpp's CUDA build links; install them or build with GPU=cpu"
            )
        arch = cuda_arch or found or STORY_CARD_ARCH
        where = "CUDA_ARCH" if cuda_arch else "the card found" if found else "the story's card class (no card found)"
        return Backend("cuda", arch, f"GPU=cuda, compute capability from {where}")
    if found is None:
        toolkit_too = "; a CUDA toolkit is here: GPU=cuda builds for a card elsewhere" if toolkit else f"; {missing}"
        return Backend("cpu", None, f"no NVIDIA GPU found by nvidia-smi{toolkit_too}")
    if not toolkit:
        return Backend("cpu", None, f"an NVIDIA GPU ({found}) but {missing} to build for it")
    return Backend("cuda", cuda_arch or found, "an NVIDIA GPU and a CUDA toolkit found")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--cuda-arch", default="", help="compute capability for cmake, e.g. 89 (default: the card's)")
    parser.add_argument("--llamafile", default="OFF", choices=("ON", "OFF"))
    parser.add_argument("--describe", action="store_true", help="say which build and why, in one line")
    args = parser.parse_args(argv)
    try:
        backend = choose(args.gpu or "auto", args.cuda_arch or None)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    print(backend.describe() if args.describe else " ".join(backend.cmake_args(args.llamafile)))


if __name__ == "__main__":
    main()
