"""Load local Hugging Face model and tokenizer folders, with errors that say what is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from spectune.errors import SpectuneError
from spectune.models.mtp_assistant import is_assistant


def check_model_dir(path: str | Path, need_weights: bool = True) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise SpectuneError(f"{path}: no such model folder")
    if not (path / "config.json").is_file():
        raise SpectuneError(f"{path}: not a Hugging Face model folder (no config.json)")
    if need_weights and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise SpectuneError(f"{path}: no weights (*.safetensors or *.bin)")
    return path


def load_tokenizer(path: str | Path, chat_template: str | Path | None = None) -> Any:
    """A local tokenizer; `chat_template` (a Jinja file) replaces or supplies the chat template."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise SpectuneError(f"{path}: no such tokenizer folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SpectuneError(f"{path}: cannot load a tokenizer: {exc}") from exc
    keep_written_normalizer(tokenizer, path)
    if chat_template is not None:
        template_path = Path(chat_template)
        if not template_path.is_file():
            raise SpectuneError(f"{template_path}: no such chat template file")
        tokenizer.chat_template = template_path.read_text(encoding="utf-8")
    return tokenizer


def keep_written_normalizer(tokenizer: Any, path: Path) -> None:
    """A tokenizer as its tokenizer.json says: transformers' Qwen2 class puts an NFC normalizer back on load even
    where the file has none (one imported from a GGUF: llama.cpp does not normalize, so HF must not either, or the
    two tokenize a decomposed "é" differently; found on 13 of 2,500 strings exporting Qwen2.5)."""
    written = path / "tokenizer.json"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is None or not written.is_file():
        return
    if json.loads(written.read_text(encoding="utf-8")).get("normalizer") is None:
        backend.normalizer = None


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """save_pretrained, plus the sentencepiece model the tokenizer was loaded with: a fast tokenizer does not write
    it back, and llama.cpp's converter reads some vocabularies (Gemma's) only from it."""
    tokenizer.save_pretrained(str(out))
    source = Path(tokenizer.name_or_path) / "tokenizer.model"
    if source.is_file() and not (out / "tokenizer.model").exists():
        shutil.copy2(source, out / "tokenizer.model")


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json (the folder checked first)."""
    return json.loads((check_model_dir(folder) / "config.json").read_text())


def is_mtp_assistant(folder: Path) -> bool:
    """Whether an HF folder is a Gemma 4 MTP assistant (it drafts from its target's states and cache)."""
    config = folder / "config.json"
    return config.is_file() and is_assistant(json.loads(config.read_text()))


def is_head(folder: Path) -> bool:
    """Whether an HF folder drafts only beside its target (an EAGLE-3 head or an MTP assistant): no standalone
    model to run, compare or quantize alone."""
    return is_eagle3_head(folder) or is_mtp_assistant(folder)


def is_eagle3_head(folder: Path) -> bool:
    """Whether an HF folder is an EAGLE-3 head (config.json as llama.cpp's converter recognises one)."""
    config = folder / "config.json"
    if not config.is_file():
        return False
    loaded = json.loads(config.read_text())
    return "draft_vocab_size" in loaded and loaded.get("num_hidden_layers") == 1
