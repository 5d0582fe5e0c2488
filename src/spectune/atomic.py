"""Write artifacts under a temporary name and rename when complete: a crash never leaves a half file."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The kinds of scratch sibling spectune writes beside an artifact: `.NAME.KIND-PID`.
SCRATCH_KINDS = ("tmp", "f16", "plain")  # "plain": a file quantized without the importance matrix, to compare


def scratch_path(final: Path, kind: str) -> Path:
    """A private sibling of `final` for this process to write; a later atomic_path sweeps it if we are killed."""
    assert kind in SCRATCH_KINDS
    return final.with_name(f".{final.name}.{kind}-{os.getpid()}")


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path (file or folder) to write; it becomes `final` only on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_path(final, "tmp")
    _remove(tmp)
    # Left by a killed process: exactly the names scratch_path writes, never a user's look-alike file.
    ours = re.compile(rf"\.{re.escape(final.name)}\.(?:{'|'.join(SCRATCH_KINDS)})-(\d+)")
    for stale in final.parent.iterdir():
        if (match := ours.fullmatch(stale.name)) and not _alive(match.group(1)):
            _remove(stale)
    try:
        yield tmp
        if final.is_dir() and tmp.is_dir():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        _remove(tmp)


def _alive(pid: str) -> bool:
    """Whether a process with this id runs."""
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
