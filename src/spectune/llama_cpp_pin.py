"""The llama.cpp spectune runs: the one vendored by the pinned llama-cpp-python, whose source distribution holds
its converter and tools' sources (fetched by pip once, cached), with spectune's patches (llama_cpp_patch.py). Below
export and engines: both build on it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from spectune.cache import built_once, cache_root
from spectune.errors import SpectuneError
from spectune.llama_cpp_patch import patch_tag

# The targets whose graph in the patched llama.cpp hands its layer inputs to an EAGLE-3 head (sets t_layer_inp): each
# GGUF architecture, with the HF model types converted to it. llama, qwen3 and qwen3moe by llama.cpp itself, qwen2
# (Qwen2.5) and gemma3 by layer-inputs.patch; on any other target llama.cpp aborts at the first decode.
HEAD_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("llama", "mistral"),
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3",),
    "qwen3moe": ("qwen3_moe",),
    "gemma3": ("gemma3_text", "gemma3"),
}
HEAD_TARGET_MODEL_TYPES = tuple(model_type for types in HEAD_TARGETS.values() for model_type in types)


def binding_version() -> str:
    """The installed llama-cpp-python's version: the pin, with `+spectune.DIGEST` where built from patched sources."""
    return version("llama-cpp-python")


def llama_cpp_version() -> str:
    """The pinned release (the binding's version without its local label): what the sources are fetched by."""
    return binding_version().split("+")[0]


def patched_build() -> str:
    """The build every llama.cpp of spectune's is made from: the pinned release with spectune's patches."""
    return f"{llama_cpp_version()}+{patch_tag()}"


def binding_patched() -> bool:
    """Whether the installed binding was built with today's patches (`make` builds it so)."""
    return binding_version() == patched_build()


def fetch_sdist() -> Path:
    """The pinned llama-cpp-python source distribution (llama.cpp's sources inside), fetched by pip once, cached."""
    pinned = llama_cpp_version()

    def download_to(tmp: Path) -> None:
        with tempfile.TemporaryDirectory() as download:
            command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d"]
            result = subprocess.run([*command, download, f"llama-cpp-python=={pinned}"], capture_output=True, text=True)
            sdists = list(Path(download).glob("llama_cpp_python-*.tar.gz"))
            if result.returncode != 0 or not sdists:
                raise SpectuneError(
                    f"could not fetch llama-cpp-python=={pinned}'s source (llama.cpp's converter and tools) through "
                    f"pip:\n{result.stderr.strip()[-800:]}\nSet SPECTUNE_LLAMA_CPP_SRC to a llama.cpp source folder "
                    "instead."
                )
            shutil.copyfile(sdists[0], tmp)

    return built_once(cache_root() / "sdist" / f"llama_cpp_python-{pinned}.tar.gz", Path.is_file, download_to)
