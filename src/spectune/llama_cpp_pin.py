"""The llama.cpp spectune runs: the one vendored by the pinned llama-cpp-python, whose source distribution holds
its converter and tools' sources (fetched by pip once, cached). Below export and engines: both build on it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from spectune.atomic import atomic_path
from spectune.cache import cache_root
from spectune.errors import SpectuneError


def llama_cpp_version() -> str:
    return version("llama-cpp-python")


def fetch_sdist() -> Path:
    """The pinned llama-cpp-python source distribution (llama.cpp's sources inside), fetched by pip once, cached."""
    pinned = llama_cpp_version()
    cached = cache_root() / "sdist" / f"llama_cpp_python-{pinned}.tar.gz"
    if cached.is_file():
        return cached
    with tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d", download]
        result = subprocess.run([*command, f"llama-cpp-python=={pinned}"], capture_output=True, text=True)
        sdists = list(Path(download).glob("llama_cpp_python-*.tar.gz"))
        if result.returncode != 0 or not sdists:
            raise SpectuneError(
                f"could not fetch llama-cpp-python=={pinned}'s source (llama.cpp's converter and tools) through pip:\n"
                f"{result.stderr.strip()[-800:]}\nSet SPECTUNE_LLAMA_CPP_SRC to a llama.cpp source folder instead."
            )
        cached.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cached) as tmp:
            shutil.copyfile(sdists[0], tmp)
    return cached
