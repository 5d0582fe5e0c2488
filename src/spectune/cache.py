"""The user cache: built demo pairs, llama.cpp's converter and tools, importance matrices; and the content hash
that names what is cached and tells a run what changed. Never the repository."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from platformdirs import user_cache_dir


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
