"""Write artifacts under a temporary name and rename when complete: a crash never leaves a half file."""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path (file or folder) to write; it becomes `final` only on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    _remove(tmp)
    for stale in final.parent.glob(f".{glob.escape(final.name)}.*-*"):  # left by a killed process
        if not _alive(stale.name.rpartition("-")[2]):
            _remove(stale)
    try:
        yield tmp
        if final.is_dir() and tmp.is_dir():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        _remove(tmp)


def _alive(pid: str) -> bool:
    """Whether a process with this id runs (a name that is no pid counts as alive: leave it alone)."""
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
