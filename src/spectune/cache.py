"""The user cache: built demo pairs, llama.cpp's converter and tools, importance matrices; and the content hash
that names what is cached and tells a run what changed. Never the repository."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from platformdirs import user_cache_dir

from spectune.atomic import atomic_path
from spectune.errors import SpectuneError


def cache_root() -> Path:
    """$SPECTUNE_CACHE, else the platform's user cache folder for spectune."""
    if os.environ.get("SPECTUNE_CACHE"):
        return Path(os.environ["SPECTUNE_CACHE"])
    return Path(user_cache_dir("spectune"))


def path_hash(path: Path) -> str:
    """Content hash of a file, or of every file in a folder (names included)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else "").encode())
        with file.open("rb") as handle:
            for block in iter(lambda handle=handle: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def built_once(final: Path, ready: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """`final`, made by `build(tmp)` into a private path renamed into place, once: a process that finds another one
    making it (two test workers, two terminals) waits on the lock file beside it, then finds it `ready`."""
    if ready(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with final.with_name(f".{final.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not ready(final):
            with atomic_path(final) as tmp:
                build(tmp)
    return final


def compiled_library(source: Path, compiler: str, flags: list[str], salt: str = "", hint: str = "") -> Path:
    """`source` compiled once into a shared library in the cache, named by its content and `salt` (what else it is
    built for, e.g. the library it links against), so an edit rebuilds it. `hint`: said where compiling fails."""
    digest = hashlib.sha256(source.read_bytes() + salt.encode()).hexdigest()[:12]
    library = cache_root() / "llama.cpp-bin" / f"{source.stem}-{digest}.so"

    def build(tmp: Path) -> None:
        found = shutil.which(compiler)
        if found is None:
            raise SpectuneError(f"no compiler ({compiler}) to build {source.name}: apt install gcc g++")
        command = [found, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(source), *flags]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise SpectuneError(f"compiling {source.name} failed{hint}:\n{result.stderr[-1500:]}")

    return built_once(library, Path.is_file, build)
