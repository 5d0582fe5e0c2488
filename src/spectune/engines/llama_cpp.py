"""llama.cpp's own binaries, built from the llama.cpp sources inside the pinned llama-cpp-python sdist with
spectune's patches (the same code the Python binding runs), once, into the user cache: `spectune tools build-llama-cpp`.

`llama-speculative-simple` is the peer `spectune bench --peer` compares our loop with; `llama-server` is the engine
`spectune serve --engine llama.cpp` hands the tuned pair to; `llama-imatrix` and `llama-quantize` quantize a model
with an importance matrix from the run's own data (export/imatrix.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from spectune.accelerator import choose
from spectune.cache import built_once, cache_root, compiled_library
from spectune.errors import SpectuneError
from spectune.llama_cpp_patch import PatchError, apply_patches
from spectune.llama_cpp_pin import fetch_sdist, llama_cpp_version, patched_build
from spectune.runtime.build import gpu_offload, llamafile_compiled

SPECULATIVE_TOOL, SERVER = "llama-speculative-simple", "llama-server"
IMATRIX_TOOL, QUANTIZE_TOOL = "llama-imatrix", "llama-quantize"  # quantizing with an importance matrix (export)
TOOLS = (SPECULATIVE_TOOL, SERVER, IMATRIX_TOOL, QUANTIZE_TOOL)
REFUSE_AMX_SOURCE = Path(__file__).with_name("refuse_amx.c")
CPUINFO = Path("/proc/cpuinfo")
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
    """llama.cpp's source tree: $SPECTUNE_LLAMA_CPP_SRC as it is (spectune's patches are the user's to apply
    there), else unpacked from the pinned sdist into the cache and patched."""
    override = os.environ.get("SPECTUNE_LLAMA_CPP_SRC")
    if override:
        if not (Path(override) / "CMakeLists.txt").is_file():
            raise SpectuneError(f"SPECTUNE_LLAMA_CPP_SRC={override}: no CMakeLists.txt there")
        return Path(override)
    prefix = f"llama_cpp_python-{llama_cpp_version()}/vendor/llama.cpp/"

    def unpack(tmp: Path) -> None:
        with tarfile.open(fetch_sdist()) as archive:
            for member in archive.getmembers():
                if member.name.startswith(prefix) and (member.isfile() or member.isdir()):
                    member.name = member.name[len(prefix) :]
                    if member.name:
                        archive.extract(member, tmp, filter="data")
        try:
            apply_patches(tmp)
        except PatchError as error:
            raise SpectuneError(str(error)) from error

    folder = cache_root() / "llama.cpp-src" / patched_build()
    return built_once(folder, lambda folder: (folder / "CMakeLists.txt").is_file(), unpack)


def _switch(on: bool) -> str:
    return "on" if on else "off"


def binding_variant() -> str:
    """The tools' build that runs the kernels the installed binding runs: cuda where it offloads to a GPU."""
    return "cuda" if gpu_offload() else "cpu"


def tools_dir(variant: str | None = None) -> Path:
    """Where the built binaries live: built with llamafile as the installed binding has it, and for its device, so
    all run the same kernels (README "Identical answers")."""
    llamafile = _switch(llamafile_compiled())
    return cache_root() / "llama.cpp-bin" / f"{patched_build()}-{variant or binding_variant()}-llamafile-{llamafile}"


def tool_path(tool: str = SPECULATIVE_TOOL, variant: str | None = None) -> Path:
    return tools_dir(variant) / tool


def built_tool(tool: str, variant: str | None = None) -> Path:
    """The binary of `tool`, or a clear error that says how to build it."""
    binary = tool_path(tool, variant)
    if not binary.is_file():
        raise SpectuneError(f"{binary} is not built yet; run `spectune tools build-llama-cpp` (~10 min on 2 cores)")
    return binary


def lib_dir(llamafile: bool) -> Path:
    return cache_root() / "llama.cpp-lib" / f"{patched_build()}-llamafile-{_switch(llamafile)}"


def _cmake(build: Path, cmake_args: tuple[str, ...], targets: tuple[str, ...], jobs: int | None) -> None:
    if shutil.which("cmake") is None:
        raise SpectuneError("cmake is not installed (needed to build llama.cpp's tools): apt install cmake")
    configure = ["cmake", "-S", str(llama_cpp_source()), "-B", str(build), *BUILD_FLAGS, *cmake_args]
    compile_ = ["cmake", "--build", str(build), "--target", *targets, "-j", str(jobs or os.cpu_count() or 1)]
    for command in (configure, compile_):
        run_tool(command, "building llama.cpp")


def run_tool(command: list[str], what: str) -> None:
    """Run one of llama.cpp's tools (or its build) to the end; a failure is an error quoting its output's tail."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:])
        raise SpectuneError(f"{what} failed (exit {result.returncode}): {' '.join(command)}\n{tail}")


def build_llama_cpp(cmake_args: tuple[str, ...] = (), variant: str | None = None, jobs: int | None = None) -> Path:
    """Build llama.cpp's tools (TOOLS) in one tree (cmake, ~10 min on 2 cores); returns their folder. Cached per
    variant (default: the binding's, cuda with CUDA_ARCH or the card's compute capability where it offloads); a
    folder missing any of them is built again (the build tree is kept: only what is new compiles)."""
    variant = variant or binding_variant()
    if variant == "cuda" and not any(arg.startswith("-DGGML_CUDA") for arg in cmake_args):
        cmake_args = (*choose("cuda", os.environ.get("CUDA_ARCH")).cmake_args()[1:], *cmake_args)
    folder = tools_dir(variant)
    build = cache_root() / "llama.cpp-build" / folder.name

    def compile_tools(tmp: Path) -> None:
        _cmake(build, (f"-DGGML_LLAMAFILE={_switch(llamafile_compiled()).upper()}", *cmake_args), TOOLS, jobs)
        tmp.mkdir(parents=True)
        for tool in TOOLS:
            shutil.copy2(build / "bin" / tool, tmp / tool)

    return built_once(folder, lambda folder: all((folder / tool).is_file() for tool in TOOLS), compile_tools)


def build_llama_libs(llamafile: bool, jobs: int | None = None) -> Path:
    """libllama and libggml as shared libraries with llamafile on or off, for LLAMA_CPP_LIB_PATH: a second build
    that a benchmark loads in a child process beside the installed one (~10 min on 2 cores). Cached."""
    folder = lib_dir(llamafile)
    build = cache_root() / "llama.cpp-build" / f"lib-{folder.name}"
    # Shared, and finding each other next to themselves ($ORIGIN) once copied out of the build tree.
    flags = (
        "-DBUILD_SHARED_LIBS=ON",
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
        f"-DGGML_LLAMAFILE={_switch(llamafile).upper()}",
    )

    def compile_libraries(tmp: Path) -> None:
        _cmake(build, flags, ("llama",), jobs)
        tmp.mkdir(parents=True)
        for library in (build / "bin").glob("lib*.so*"):
            shutil.copy2(library, tmp / library.name, follow_symlinks=False)

    return built_once(folder, lambda folder: (folder / "libllama.so").is_file(), compile_libraries)


def cpu_has_amx(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU offers AMX tiles (Linux's `amx_tile` flag), which ggml uses when built for it (native)."""
    return cpuinfo.is_file() and "amx_tile" in cpuinfo.read_text().split()


def refuse_amx_library() -> Path:
    """refuse_amx.c compiled once into the cache (named by its source's hash, so an edit rebuilds it)."""
    return compiled_library(REFUSE_AMX_SOURCE, "cc", ["-ldl"])


def defaults_env(cpuinfo: Path = CPUINFO) -> dict[str, str]:
    """What a llama.cpp tool run at its own defaults needs on this machine: on a CPU with AMX, AMX refused
    (refuse_amx.c: the pinned llama.cpp's AMX kernels crash here, exit 139, on every model tried), every other
    default kept; nothing elsewhere."""
    return {"LD_PRELOAD": str(refuse_amx_library())} if cpu_has_amx(cpuinfo) else {}
