"""llama.cpp's own speculative decoder (`llama-speculative-simple`) as a peer: same GGUFs, prompts and settings,
so spectune's loop is compared with llama.cpp's in one run (`spectune bench --peer llama.cpp`).

The tool is built from the llama.cpp sources inside the pinned llama-cpp-python sdist (the same code the Python
binding runs), once, into the user cache: `spectune tools build-llama-cpp`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from spectune.atomic import atomic_path
from spectune.cache import cache_root
from spectune.errors import SpectuneError
from spectune.export.converter import fetch_sdist, llama_cpp_version
from spectune.runtime.build import llamafile_compiled

TOOL = "llama-speculative-simple"
LOG_ATTEMPTS = 8
# No web UI, no TLS, static binaries (relocatable, so the finished build can be renamed into place).
BUILD_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)


def llama_cpp_source() -> Path:
    """llama.cpp's source tree: $SPECTUNE_LLAMA_CPP_SRC, else unpacked from the pinned sdist into the cache."""
    override = os.environ.get("SPECTUNE_LLAMA_CPP_SRC")
    if override:
        if not (Path(override) / "CMakeLists.txt").is_file():
            raise SpectuneError(f"SPECTUNE_LLAMA_CPP_SRC={override}: no CMakeLists.txt there")
        return Path(override)
    folder = cache_root() / "llama.cpp-src" / llama_cpp_version()
    if (folder / "CMakeLists.txt").is_file():
        return folder
    prefix = f"llama_cpp_python-{llama_cpp_version()}/vendor/llama.cpp/"
    with atomic_path(folder) as tmp, tarfile.open(fetch_sdist()) as archive:
        for member in archive.getmembers():
            if member.name.startswith(prefix) and (member.isfile() or member.isdir()):
                member.name = member.name[len(prefix) :]
                if member.name:
                    archive.extract(member, tmp, filter="data")
    return folder


def _switch(on: bool) -> str:
    return "on" if on else "off"


def tool_path(variant: str = "cpu") -> Path:
    """The peer binary, built with llamafile as the installed binding has it, so both run the same kernels."""
    llamafile = _switch(llamafile_compiled())
    return cache_root() / "llama.cpp-bin" / f"{llama_cpp_version()}-{variant}-llamafile-{llamafile}" / TOOL


def lib_dir(llamafile: bool) -> Path:
    return cache_root() / "llama.cpp-lib" / f"{llama_cpp_version()}-llamafile-{_switch(llamafile)}"


def _cmake(build: Path, cmake_args: tuple[str, ...], target: str, jobs: int | None) -> None:
    if shutil.which("cmake") is None:
        raise SpectuneError("cmake is not installed (needed to build llama.cpp's tools): apt install cmake")
    configure = ["cmake", "-S", str(llama_cpp_source()), "-B", str(build), *BUILD_FLAGS, *cmake_args]
    compile_ = ["cmake", "--build", str(build), "--target", target, "-j", str(jobs or os.cpu_count() or 1)]
    for command in (configure, compile_):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:])
            raise SpectuneError(f"building llama.cpp failed: {' '.join(command)}\n{tail}")


def build_llama_cpp(cmake_args: tuple[str, ...] = (), variant: str = "cpu", jobs: int | None = None) -> Path:
    """Build `llama-speculative-simple` (cmake, ~11 min on 2 cores); returns the binary. Cached per variant."""
    binary = tool_path(variant)
    if binary.is_file():
        return binary
    build = cache_root() / "llama.cpp-build" / binary.parent.name
    _cmake(build, (f"-DGGML_LLAMAFILE={_switch(llamafile_compiled()).upper()}", *cmake_args), TOOL, jobs)
    with atomic_path(binary) as tmp:
        shutil.copy2(build / "bin" / TOOL, tmp)
    return binary


def build_llama_libs(llamafile: bool, jobs: int | None = None) -> Path:
    """libllama and libggml as shared libraries with llamafile on or off, for LLAMA_CPP_LIB_PATH: a second build
    that a benchmark loads in a child process beside the installed one (~10 min on 2 cores). Cached."""
    folder = lib_dir(llamafile)
    if (folder / "libllama.so").is_file():
        return folder
    build = cache_root() / "llama.cpp-build" / f"lib-{folder.name}"
    # Shared, and finding each other next to themselves ($ORIGIN) once copied out of the build tree.
    flags = (
        "-DBUILD_SHARED_LIBS=ON",
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
        f"-DGGML_LLAMAFILE={_switch(llamafile).upper()}",
    )
    _cmake(build, flags, "llama", jobs)
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        for library in (build / "bin").glob("lib*.so*"):
            shutil.copy2(library, tmp / library.name, follow_symlinks=False)
    return folder


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
