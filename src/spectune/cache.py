"""The user cache: built demo pairs, llama.cpp's converter and tools. Never the repository."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir


def cache_root() -> Path:
    """$SPECTUNE_CACHE, else the platform's user cache folder for spectune."""
    if os.environ.get("SPECTUNE_CACHE"):
        return Path(os.environ["SPECTUNE_CACHE"])
    return Path(user_cache_dir("spectune"))
