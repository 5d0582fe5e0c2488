"""A model as people name it, wherever spectune takes one: a local Hugging Face folder, a GGUF file (imported once
into the user cache, as `spectune models import` does), or a hub id such as `Qwen/Qwen2.5-1.5B-Instruct` (fetched
once into huggingface_hub's own cache; offline, or with HF_HUB_OFFLINE=1, read from that cache)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

from spectune.cache import cache_root
from spectune.errors import SpectuneError
from spectune.models.imported import REAL_MODELS, fetch, import_gguf
from spectune.models.load import check_model_dir

# owner/name, optionally @revision (a branch, tag or commit), as the hub spells repository ids
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# How a model setting's help says what it takes.
MODEL_REFERENCE = "an HF folder, a GGUF file or a hub id (owner/name)"
# What a causal LM needs to be fine-tuned and exported: config, weights, tokenizer, chat template.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken"]


def is_hub_id(reference: str | Path) -> bool:
    """Whether `reference` names a hub repository rather than a local path (which wins where both could be meant)."""
    return not Path(reference).exists() and HUB_ID.match(str(reference)) is not None


def resolve_model(reference: str | Path) -> Path:
    """The local HF folder for `reference`: the folder itself, a GGUF's import, or a hub id's snapshot."""
    path = Path(reference)
    if path.is_dir():
        return check_model_dir(path)
    if path.suffix == ".gguf":
        return imported_gguf(path)
    if is_hub_id(reference):
        return check_model_dir(hub_snapshot(str(reference)))
    raise SpectuneError(f"{reference}: no such model folder, GGUF file or hub id (owner/name)")


def model_folder(reference: str | Path) -> Path:
    """The local HF folder for a real model's name (fetched into the user cache) or any other model reference."""
    return fetch(str(reference)) if str(reference) in REAL_MODELS else resolve_model(reference)


def imported_gguf(gguf: Path) -> Path:
    """The HF folder a GGUF file imports to, made once per file (its path, size and time of change)."""
    if not gguf.is_file():
        raise SpectuneError(f"{gguf}: no such GGUF file")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / "imported" / f"{gguf.stem}-{key}"
    return out if (out / "config.json").is_file() else import_gguf(gguf, out)


def hub_snapshot(hub_id: str) -> Path:
    """A hub repository's files in huggingface_hub's cache: fetched where they are not there yet."""
    match = HUB_ID.match(hub_id)
    assert match is not None
    try:
        folder = snapshot_download(match["repo"], revision=match["revision"], allow_patterns=HUB_FILES)
    except LocalEntryNotFoundError as exc:
        raise SpectuneError(
            f"{hub_id}: not in the Hugging Face cache, and the hub cannot be reached (offline, or HF_HUB_OFFLINE=1); "
            "fetch it once where there is a network (`hf download " + match["repo"] + "`), or give a local folder"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise SpectuneError(f"{hub_id}: no such model on the hub (or it needs a token: `hf auth login`)") from exc
    except HfHubHTTPError as exc:
        raise SpectuneError(f"{hub_id}: the hub refused it: {exc}") from exc
    return Path(folder)
