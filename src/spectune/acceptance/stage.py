"""`spectune acceptance`: the meter on every draft, c per draft and card, and each draft's recommended k."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import Field

from spectune.acceptance.draft_types import DraftTypesSettings, card_profiles, sweep_types
from spectune.acceptance.meter import Profile, encode, measure
from spectune.atomic import atomic_path
from spectune.data.prepare import read_prompts
from spectune.data.read import assistant_turns
from spectune.errors import SpectuneError
from spectune.export.pair import CALIBRATION_DIALOGUES, calibration_text, held_out
from spectune.layout import TARGET
from spectune.models.load import is_eagle3_head, is_head, is_mtp_assistant, load_tokenizer, read_config
from spectune.models.mtp_assistant import check_fit
from spectune.models.resolve import MODEL_REFERENCE, resolve_model
from spectune.runtime.decode import DEFAULT_MAX_TOKENS
from spectune.runtime.ngram import NgramSettings, domain_of_texts
from spectune.runtime.profile import gguf_weights
from spectune.speedup import Weights
from spectune.threads import ThreadsSettings, configure_torch_threads
from spectune.train.eagle3_head import load_head

HERE = "here"  # the key of a profile measured on this machine


class AcceptanceSettings(DraftTypesSettings):
    """The offline meter's settings: the `acceptance:` section of a run config and flags of `spectune acceptance`."""

    n: int = Field(30, ge=1, description="Held-out prompts the target answers.")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="Longest target answer.")
    temperature: float = Field(0.0, ge=0.0, description="Also measure sampling acceptance at this temperature.")


class AcceptanceConfig(AcceptanceSettings, ThreadsSettings):
    """Everything `spectune acceptance` takes."""

    target: Path = Field(description=f"The (fine-tuned, merged) target: {MODEL_REFERENCE}.")
    drafts: dict[str, Path] = Field(description=f"Drafts by name, each {MODEL_REFERENCE}.")
    data: Path = Field(description="Held-out prompts: a chat dataset or a `data prompts` file.")
    profile: Path | None = Field(
        None, description="Measured profile JSON (cost_ratio, verify_ratio): a pair manifest or a bench report."
    )
    ngram: NgramSettings | None = Field(
        None, description="Also n-gram lookup: `ngram` alone, and `ngram+DRAFT` in front of every draft."
    )
    ngram_data: Path | None = Field(
        None, description="The n-gram domain table's answers (chat JSONL: the tuned target's own, from seqkd)."
    )
    ggufs: dict[str, Path] = Field(
        {},
        description="The exported GGUFs by name (the target's as `target`): c on a GPU is what a step reads of them "
        "in bytes, as the bench predicts with; without them, of the HF weights (elements, one width for both).",
    )
    calibration_data: Path | None = Field(
        None,
        description="The dialogues the export computed importance matrices on: a draft's other types are quantized "
        "with its matrix too (none: plain).",
    )
    json_out: Path | None = Field(None, description="Also write the results as JSON here.")


def load_models(target: Path, drafts: dict[str, Path]) -> tuple[Any, dict[str, Any], dict[str, Any], Any]:
    """The target, the draft models, the heads (EAGLE-3 heads on the target's embedding, MTP assistants checked
    against the target) and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    def load(path: Path) -> Any:
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()

    target = resolve_model(target)
    target_model = load(target)
    paths = {name: resolve_model(path) for name, path in drafts.items()}
    models = {name: load(path) for name, path in paths.items() if not is_head(path)}
    heads = {name: load_head(path, target_model) for name, path in paths.items() if is_eagle3_head(path)}
    for name, path in paths.items():
        if is_mtp_assistant(path):
            check_fit(target, read_config(target), path, read_config(path))
            heads[name] = load(path)
    return target_model, models, heads, load_tokenizer(target)


def module_weights(model: Any) -> Weights:
    """An HF model's weights in elements (a tied head and embedding share one table); an EAGLE-3 head's own (it
    reads one row of the target's embedding)."""
    if not hasattr(model, "get_input_embeddings"):
        return Weights(total=sum(p.numel() for p in model.parameters()), embedding=0, rows=1, tied=False)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    return Weights(
        total=sum(p.numel() for p in model.parameters()),  # parameters() yields a shared table once
        embedding=embedding.numel(),
        rows=embedding.shape[0],
        tied=head is not None and head.weight is embedding,
    )


def gpu_profiles(config: AcceptanceConfig, target: Any, drafts: dict[str, Any]) -> dict[str, list[Profile]]:
    """Each draft's GPU profiles (draft_types.card_profiles): of the GGUFs where given (bytes, and on the
    reference card, which needs bytes and layers), else of the HF weights (elements, one width for both)."""
    if not config.ggufs:
        target_weights = module_weights(target)
        return {
            name: card_profiles(module_weights(model), target_weights, "HF weights") for name, model in drafts.items()
        }
    missing = sorted({TARGET, *drafts} - set(config.ggufs))
    if missing:
        raise SpectuneError(f"ggufs: no GGUF for {', '.join(missing)} (give the target's and every draft's)")
    target_weights = gguf_weights(config.ggufs[TARGET])
    return {name: card_profiles(gguf_weights(config.ggufs[name]), target_weights, "GGUF bytes") for name in drafts}


def read_profile(path: Path) -> Profile:
    """A measured profile from JSON: a profile object, or a pair manifest holding one `profile_<quant>`."""
    loaded = json.loads(path.read_text())
    measured = sorted(key for key in loaded if key.startswith("profile_"))
    if len(measured) > 1:
        raise SpectuneError(f"{path}: profiles at several quant types ({', '.join(measured)}); give one profile's JSON")
    loaded = loaded[measured[0]] if measured else loaded.get("profile", loaded)
    if "cost_ratio" not in loaded or "verify_ratio" not in loaded:
        raise SpectuneError(f"{path}: no cost_ratio / verify_ratio (a profile or a pair manifest)")
    return Profile(
        HERE,
        f"here ({loaded.get('machine', 'measured')})",
        float(loaded["cost_ratio"]),
        {str(n): float(r) for n, r in loaded["verify_ratio"].items()},
    )


def draft_types_of(config: AcceptanceConfig, prompts: list) -> dict[str, Any]:
    """Every draft model at every type of `draft_types`, in llama.cpp on its GGUF (draft_types.sweep_types)."""
    folders = {name: resolve_model(path) for name, path in config.drafts.items()}
    models = {name: folder for name, folder in folders.items() if not is_head(folder)}
    dialogues = held_out(config.calibration_data, CALIBRATION_DIALOGUES) if config.calibration_data else []
    calibration = {name: calibration_text(folder, dialogues) for name, folder in models.items()} if dialogues else {}
    drafts = {name: (folder, config.ggufs[name]) for name, folder in models.items()}
    return sweep_types(
        config.ggufs[TARGET],
        drafts,
        prompts,
        config.max_tokens,
        config.draft_types,
        calibration,
        config.threads,
        config.type_margin,
    )


def run_acceptance(config: AcceptanceConfig) -> dict[str, Any]:
    """The `spectune acceptance` stage: every draft against the target, on `n` held-out prompts."""
    configure_torch_threads(config.threads)
    measured = [read_profile(config.profile)] if config.profile is not None else []
    prompts = read_prompts(config.data)[: config.n]
    target_model, draft_models, heads, tokenizer = load_models(config.target, config.drafts)
    gpu = gpu_profiles(config, target_model, draft_models | heads)
    # a measured profile (--profile) is a draft model's c here; a head's step costs far less (bench measures it)
    profiles = {name: [*measured, *gpu[name]] for name in draft_models} | {name: gpu[name] for name in heads}
    ngram = None
    if config.ngram is not None:
        answers = assistant_turns(config.ngram_data) if config.ngram_data else []
        ngram = (config.ngram, domain_of_texts(config.ngram, answers, functools.partial(encode, tokenizer)))
    results = measure(
        target_model, draft_models, tokenizer, prompts, profiles, config.max_tokens, config.temperature, ngram, heads
    )
    report = {
        "target": str(config.target),
        "data": str(config.data),
        "prompts": len(prompts),
        "temperature": config.temperature,
        # the profiles' keys and names; each draft's c is in its row
        "profiles": [{"key": p.key, "name": p.name} for p in next(iter(profiles.values()))],
        "ngram": config.ngram.model_dump() if config.ngram else None,
        "ngram_data": str(config.ngram_data) if config.ngram and config.ngram_data else None,
        "drafts": [json.loads(json.dumps(asdict(r))) for r in results],  # int keys -> str, as in the file
    }
    if config.ggufs and config.draft_types:
        report["draft_types"] = draft_types_of(config, prompts)
    if config.json_out is not None:
        with atomic_path(config.json_out) as tmp:
            tmp.write_text(json.dumps(report, indent=2))
    return report
