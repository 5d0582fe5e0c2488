"""A built demo pair exported to GGUF and its hardware profile (c, r(n)) measured here, kept in its manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spectune.export.gguf import export_model
from spectune.layout import DEFAULT_QUANT
from spectune.models.demo_pair import read_manifest, write_manifest
from spectune.runtime.profile import measure_profile


def profile_pair(folder: Path, quant: str = DEFAULT_QUANT, force: bool = False) -> dict[str, Any]:
    """Export both models of a built pair to `quant` GGUFs and record the measured hardware profile."""
    manifest = read_manifest(folder)
    key = f"profile_{quant}"
    if key in manifest and not force:
        return manifest[key]
    ggufs = {}
    for role in ("target", "draft"):
        ggufs[role] = folder / "gguf" / f"{role}.{quant}.gguf"
        if force or not ggufs[role].is_file():
            export_model(folder / role, ggufs[role], quant)
    profile = measure_profile(ggufs["target"], ggufs["draft"])
    profile["quant"] = quant
    manifest[key] = profile
    write_manifest(folder, manifest)
    return profile
