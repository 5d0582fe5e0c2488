"""llama.cpp's HF -> GGUF converter, from the source distribution of the pinned llama-cpp-python.

The converter (`convert_hf_to_gguf.py`, its `conversion/` package and the matching `gguf-py`) ships in the sdist,
not in the wheel, and differs from PyPI's `gguf`. At first use it is fetched through pip, unpacked into the user
cache (keyed by version) and run in a subprocess; none of its code lives in this repository.
Set SPECTUNE_LLAMA_CPP_SRC to a llama.cpp source folder to use that instead (air-gapped machines).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from spectune.cache import built_once, cache_root
from spectune.errors import SpectuneError
from spectune.llama_cpp_pin import fetch_sdist, llama_cpp_version

PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "common/arg.cpp")  # arg.cpp: the tools' flags


def _unpack_sdist(out: Path) -> None:
    with tarfile.open(fetch_sdist()) as archive:
        for member in archive.getmembers():
            parts = member.name.split("/", 3)  # <pkg>/vendor/llama.cpp/<path>
            if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"]:
                continue
            relative = parts[3]
            if not any(relative == p or relative.startswith(p) for p in PARTS) or not member.isfile():
                continue
            target = out / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            source = archive.extractfile(member)
            assert source is not None
            target.write_bytes(source.read())


def converter_dir() -> Path:
    """The folder holding convert_hf_to_gguf.py, fetched and cached on first use."""
    override = os.environ.get("SPECTUNE_LLAMA_CPP_SRC")
    if override:
        folder = Path(override)
        if not (folder / "convert_hf_to_gguf.py").is_file():
            raise SpectuneError(f"SPECTUNE_LLAMA_CPP_SRC={folder}: no convert_hf_to_gguf.py there")
        return folder
    folder = cache_root() / "llama.cpp-converter" / llama_cpp_version()
    names = ("convert_hf_to_gguf.py", "common/arg.cpp")
    return built_once(folder, lambda folder: all((folder / name).is_file() for name in names), _unpack_sdist)


def declared_pre_tokenizer(model_dir: Path) -> str | None:
    """The pre-tokenizer a spectune-made tokenizer declares (see models/tokenizer.py), else None."""
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text(encoding="utf-8")).get("spectune_pre_tokenizer")


def run_converter(model_dir: Path, out_file: Path, outtype: str, target_model_dir: Path | None = None) -> None:
    """Run convert_hf_to_gguf.py in a subprocess, writing `out_file` (the caller makes that atomic). An EAGLE-3
    head needs `target_model_dir`: the target it drafts for, whose tokenizer and config the converter reads."""
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise SpectuneError(f"{model_dir}: no tokenizer.json or tokenizer.model (the GGUF needs the tokenizer)")
    folder = converter_dir()
    command = [
        sys.executable,
        "-m",
        "spectune.export._run_converter",
        str(folder),
        declared_pre_tokenizer(target_model_dir or model_dir) or "",
        str(model_dir),
        "--outfile",
        str(out_file),
        "--outtype",
        outtype,
        *(("--target-model-dir", str(target_model_dir)) if target_model_dir else ()),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 and "not supported" in result.stderr:
        config = json.loads((model_dir / "config.json").read_text())
        raise SpectuneError(
            f"{model_dir}: architecture {config.get('architectures')} is not supported by llama.cpp's converter; "
            f"it converts: {', '.join(supported_text_models(folder))}"
        )
    unmapped = re.search(r"Can not map tensor '([^']+)'", result.stderr)
    if result.returncode != 0 and unmapped:
        config = json.loads((model_dir / "config.json").read_text())
        raise SpectuneError(
            f"{model_dir}: llama.cpp's converter ({llama_cpp_version()}) cannot map the tensor {unmapped.group(1)!r} "
            f"of this {config.get('architectures')} checkpoint to GGUF: a weight the pinned llama.cpp does not know "
            "for this architecture (a newer variant of it, or an extra module such as an adapter not merged)"
        )
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-12:])
        raise SpectuneError(f"llama.cpp's converter failed on {model_dir}:\n{tail}")


def supported_text_models(folder: Path) -> list[str]:
    """The text architectures the converter knows (its --print-supported-models, which logs to stderr)."""
    command = [sys.executable, "-m", "spectune.export._run_converter", str(folder), "", "--print-supported-models"]
    listing = subprocess.run(command, capture_output=True, text=True).stderr
    text_part = listing.split("TEXT models:", 1)[-1].split("models:", 1)[0]
    return [line.strip()[2:] for line in text_part.splitlines() if line.strip().startswith("- ")]
