"""HF folder -> GGUF (llama.cpp's converter) -> quantized GGUF (libllama's llama_model_quantize).

Both steps write under a temporary name and rename when complete: an interrupted export leaves no .gguf
under the final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import Field

from spectune.atomic import atomic_path, scratch_path
from spectune.config import Settings
from spectune.errors import SpectuneError
from spectune.export.converter import run_converter
from spectune.export.imatrix import IMATRIX_TYPES, importance_matrix, quantize_with
from spectune.layout import DEFAULT_QUANT
from spectune.models.load import is_eagle3_head
from spectune.runtime.llama import init_backend
from spectune.threads import thread_count

# What the converter writes directly.
CONVERTER_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}
# llama_ftype values of libllama (include/llama.h) for what quantization produces.
QUANT_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
QUANT_TYPES = sorted(set(QUANT_FTYPES) | set(CONVERTER_TYPES))


class QuantSettings(Settings):
    """What a GGUF is quantized to (every verb and section that exports extends this)."""

    quant: str = Field(DEFAULT_QUANT, description="GGUF type: " + ", ".join(QUANT_TYPES) + ".")
    keep_f16: bool = Field(False, description="Keep the F16 GGUF quantization started from.")


def check_quant(quant: str) -> str:
    name = quant.upper()
    if name not in QUANT_FTYPES and name not in CONVERTER_TYPES:
        raise SpectuneError(f"unknown quant type {quant!r}: choose one of {', '.join(QUANT_TYPES)}")
    return name


def convert(
    model_dir: str | Path, out_file: str | Path, outtype: str = "F16", target_model_dir: Path | None = None
) -> Path:
    """Convert an HF model folder to a GGUF file of `outtype` (F32, F16, BF16 or Q8_0); an EAGLE-3 head with the
    target it drafts for."""
    outtype = check_quant(outtype)
    if outtype not in CONVERTER_TYPES:
        raise SpectuneError(f"the converter writes {', '.join(CONVERTER_TYPES)}; {outtype} needs quantize()")
    out_file = Path(out_file)
    with atomic_path(out_file) as tmp:
        run_converter(Path(model_dir), tmp, CONVERTER_TYPES[outtype], target_model_dir)
    return out_file


def quantize(in_file: str | Path, out_file: str | Path, quant: str = DEFAULT_QUANT, threads: int | None = None) -> Path:
    """Quantize a GGUF with libllama (no llama.cpp binary needed)."""
    import llama_cpp

    init_backend()
    quant = check_quant(quant)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_FTYPES[quant]
    params.nthread = thread_count(threads)
    out_file = Path(out_file)
    with atomic_path(out_file) as tmp:
        status: list[int] = []
        failed: list[BaseException] = []

        def work() -> None:
            try:
                status.append(llama_cpp.llama_model_quantize(str(in_file).encode(), str(tmp).encode(), params))
            except BaseException as exc:  # handed to the waiting thread, which raises it
                failed.append(exc)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while worker.is_alive():  # the C call cannot be interrupted; waiting here keeps Ctrl-C working
            worker.join(0.2)
        if failed:
            raise failed[0]
        if status != [0]:
            raise SpectuneError(f"llama_model_quantize failed on {in_file} -> {quant} (status {status})")
    return out_file


def export_model(
    model_dir: str | Path,
    out_file: str | Path,
    quant: str = DEFAULT_QUANT,
    keep_f16: bool = False,
    target_model_dir: Path | None = None,
    calibration: str | None = None,
    report: dict[str, Any] | None = None,
) -> Path:
    """HF folder -> GGUF of `quant`; other quant types go through an F16 GGUF that libllama quantizes, made in a
    private temporary folder (kept as OUT.f16.gguf with `keep_f16`), so no file beside `out_file` is touched. An
    EAGLE-3 head takes `target_model_dir`, the target it drafts for. With `calibration` text, a type that can use
    one is quantized with an importance matrix of the model on it (export/imatrix.py), said in `report["imatrix"]`."""
    quant = check_quant(quant)
    model_dir, out_file = Path(model_dir), Path(out_file)
    if not model_dir.is_dir():
        raise SpectuneError(f"{model_dir}: no such model folder")
    if is_eagle3_head(model_dir) and target_model_dir is None:
        raise SpectuneError(f"{model_dir} is an EAGLE-3 head: give the target it drafts for (--target-model-dir)")
    if quant in CONVERTER_TYPES:
        return convert(model_dir, out_file, quant, target_model_dir)
    with f16_scratch(model_dir, out_file, target_model_dir) as intermediate:
        quantize_f16(intermediate, out_file, quant, calibration, report)
        if keep_f16:
            os.replace(intermediate, out_file.with_name(out_file.stem + ".f16.gguf"))
    return out_file


@contextlib.contextmanager
def f16_scratch(model_dir: Path, out_file: Path, target_model_dir: Path | None = None) -> Iterator[Path]:
    """The model converted to an F16 GGUF in a private temporary folder beside `out_file`, removed on exit."""
    scratch = scratch_path(out_file, "f16")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        yield convert(model_dir, scratch / "model.f16.gguf", "F16", target_model_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def quantize_f16(
    f16: Path, out_file: Path, quant: str, calibration: str | None = None, report: dict[str, Any] | None = None
) -> Path:
    """An F16 GGUF quantized to `quant`: weighted by an importance matrix on `calibration` where the type takes one
    (said in `report["imatrix"]`), else plainly."""
    if calibration is not None and quant in IMATRIX_TYPES:
        matrix, info = importance_matrix(f16, calibration)
        quantize_with(f16, out_file, quant, matrix)
        if report is not None:
            report["imatrix"] = info
        return out_file
    return quantize(f16, out_file, quant)
