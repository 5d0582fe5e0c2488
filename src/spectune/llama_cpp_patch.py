"""spectune's patches to the pinned llama.cpp, applied to its sources before both builds: the Python binding
(`make` installs llama-cpp-python from the patched sdist) and llama.cpp's own tools (`spectune tools build-llama-cpp`).

layer-inputs.patch: the qwen2 and gemma3 graphs hand their layers' inputs to an EAGLE-3 head, as the llama graph
does (`res->t_layer_inp[il] = inpL;`): without it llama.cpp runs heads only for llama-architecture targets.

A patched binding says so in its version: `0.3.36+spectune.DIGEST`, DIGEST the patches' own (pip's `==0.3.36` pin
accepts a local version). Standard library only: `make` runs this before anything else is installed:

    python -m spectune.llama_cpp_patch SDIST OUT   # unpacks SDIST into OUT, patches it, prints the source folder
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
from pathlib import Path

PATCHES = sorted((Path(__file__).parent / "llama_cpp_patches").glob("*.patch"))
VENDORED = Path("vendor") / "llama.cpp"  # llama.cpp's sources inside the llama-cpp-python sdist


class PatchError(RuntimeError):
    """A patch that does not apply (a llama.cpp other than the pinned one)."""


def patch_tag() -> str:
    """The local version label of a binding built with these patches: spectune.DIGEST."""
    digest = hashlib.sha256(b"".join(patch.read_bytes() for patch in PATCHES)).hexdigest()[:8]
    return f"spectune.{digest}"


def apply_patches(llama_cpp_root: Path) -> None:
    """Apply every patch to a llama.cpp source tree (paths inside it, -p1)."""
    for patch in PATCHES:
        command = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(llama_cpp_root)]
        result = subprocess.run([*command, "-i", str(patch)], capture_output=True, text=True)
        if result.returncode != 0:
            raise PatchError(f"{patch.name} does not apply to {llama_cpp_root}:\n{result.stdout[-800:]}")


def patched_binding_source(sdist: Path, out: Path) -> Path:
    """The llama-cpp-python sdist unpacked into `out`, its llama.cpp patched and its version labelled."""
    with tarfile.open(sdist) as archive:
        archive.extractall(out, filter="data")
    (source,) = [folder for folder in out.iterdir() if (folder / VENDORED).is_dir()]
    apply_patches(source / VENDORED)
    init = source / "llama_cpp" / "__init__.py"
    labelled = rf'__version__ = "\1+{patch_tag()}"'
    text, count = re.subn(r'^__version__ = "([^"+]+)"', labelled, init.read_text(), count=1, flags=re.M)
    if count != 1:
        raise PatchError(f"{init}: no __version__ line to label")
    init.write_text(text)
    return source


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m spectune.llama_cpp_patch SDIST OUT")
    try:
        print(patched_binding_source(Path(sys.argv[1]), Path(sys.argv[2])))
    except (PatchError, ValueError, OSError, tarfile.TarError) as error:
        sys.exit(f"spectune.llama_cpp_patch: {error}")
