"""Export a target and its draft together, and check llama.cpp will accept them as a speculative pair,
that llama.cpp tokenizes exactly like HF, and how much the quantization changed the models."""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from spectune.atomic import atomic_path, scratch_path
from spectune.data.read import read_dialogues
from spectune.engines.llama_cpp import IMATRIX_TOOL, QUANTIZE_TOOL, SERVER, build_llama_cpp, tool_path
from spectune.engines.llama_server import server_command
from spectune.errors import SpectuneError
from spectune.export.gguf import QuantSettings, check_quant, export_model, quantize
from spectune.export.llama_flags import check_command
from spectune.layout import CHOSEN_PAIR, CONTROL_DRAFT, EXPORT_REPORT, SERVER_SCRIPT, TARGET, gguf_name
from spectune.models.load import is_eagle3_head, is_head, is_mtp_assistant, load_tokenizer
from spectune.models.resolve import MODEL_REFERENCE, resolve_model
from spectune.models.tokenizer_check import check_template, check_tokenizer
from spectune.runtime.chosen import ChosenPair
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel, spec_type
from spectune.runtime.ngram import NGRAM
from spectune.runtime.pair import check_pair
from spectune.runtime.registry import Variant
from spectune.speedup import DEFAULT_DRAFT_MAX, GPU_PROFILE
from spectune.threads import ThreadsSettings, thread_count

TOKENIZER_DIALOGUES = 500  # held-out dialogues the tokenizer identity is checked on, beside the stress strings
# Training dialogues an importance matrix is computed on: llama-imatrix reads at most MAX_CHUNKS of them anyway
CALIBRATION_DIALOGUES = 1000


def fidelity(hf_dir: Path, gguf: Path, texts: list[str], threads: int | None = None) -> dict[str, Any]:
    """Top-1 next-token agreement of a GGUF with the HF model, and the perplexity of each, on `texts`."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, dtype=torch.float32).eval()
    model = LlamaModel(gguf, n_ctx=1024, threads=threads)
    agree = total = 0
    nll_hf = nll_gguf = 0.0
    try:
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:1000]
            if len(ids) < 2:
                continue
            with torch.no_grad():
                expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1).numpy()
            model.truncate(0)
            got = model.decode(ids, 0)
            got = (
                got
                - np.log(np.exp(got - got.max(-1, keepdims=True)).sum(-1, keepdims=True))
                - got.max(-1, keepdims=True)
            )
            targets = np.array(ids[1:])
            rows = np.arange(len(targets))
            agree += int((expected[:-1].argmax(-1) == got[:-1].argmax(-1)).sum())
            nll_hf -= float(expected[rows, targets].sum())
            nll_gguf -= float(got[rows, targets].sum())
            total += len(targets)
    finally:
        model.close()
    if total == 0:
        raise SpectuneError("no evaluation text long enough for a fidelity check")
    return {
        "tokens": total,
        "top1_agreement": agree / total,
        "perplexity_hf": math.exp(nll_hf / total),
        "perplexity_gguf": math.exp(nll_gguf / total),
    }


class ExportSettings(QuantSettings):
    """The `export:` section of a run config and the flags of `spectune export-pair`."""

    fidelity_dialogues: int = Field(20, ge=0, description="Held-out dialogues the HF-vs-GGUF fidelity is measured on.")
    imatrix: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Quantize with an importance matrix of each model on the run's training dialogues (llama.cpp's "
        "llama-imatrix and llama-quantize): on (builds the tools if needed), auto (where they are built), off.",
    )


class ExportPairConfig(ExportSettings, ThreadsSettings):
    """Everything `spectune export-pair` takes."""

    target: Path = Field(description=f"The merged target: {MODEL_REFERENCE}.")
    drafts: dict[str, Path] = Field(description=f"Drafts by name, each {MODEL_REFERENCE}.")
    out: Path = Field(description="Output folder: the GGUFs, export.json, pair.json, llama-server.sh.")
    data: Path | None = Field(None, description="Held-out dialogues for the fidelity report.")
    calibration_data: Path | None = Field(
        None, description="Training dialogues each model's importance matrix is computed on (with --imatrix)."
    )
    acceptance: Path | None = Field(
        None, description="An acceptance report: serve its best tuned draft at its recommended k."
    )


def choose_draft(drafts: list[str], acceptance: dict[str, Any] | None) -> tuple[Variant, int]:
    """(variant to serve, its k): the tuned draft, or n-gram lookup in front of it, with the best predicted GPU
    speedup at its recommended k (on the reference card where the acceptance stage had it)."""
    if acceptance is None:
        return Variant(draft=drafts[0]), DEFAULT_DRAFT_MAX
    # each draft model, alone or with n-gram lookup in front (lookup alone is measured, but a pair serves a draft)
    servable = [Variant(draft=name) for name in drafts] + [Variant((NGRAM,), name) for name in drafts]
    rows = {row["name"]: row for row in acceptance["drafts"]}
    measured = [variant for variant in servable if variant.name in rows]
    tuned = [variant for variant in measured if variant.draft != CONTROL_DRAFT] or measured
    if not tuned:
        raise SpectuneError(f"the acceptance report has none of the drafts {', '.join(drafts)}")
    row = {variant: rows[variant.name] for variant in tuned}

    def predicted(variant: Variant) -> float:  # at its recommended k, on the profile that k was chosen by
        figures = row[variant]
        return figures["speedup"][figures.get("recommended_by", GPU_PROFILE)][str(figures["recommended_k"])]

    best = max(tuned, key=predicted)
    return best, row[best]["recommended_k"]


def export_checked(
    config: ExportPairConfig,
    folder: Path,
    out_file: Path,
    conversations: list[list[dict[str, str]]],
    calibration: list[list[dict[str, str]]],
) -> dict:
    """Export one model (with an importance matrix on the `calibration` dialogues, rendered with its own chat
    template, where there are some), check llama.cpp tokenizes like HF (stress strings and the held-out
    `conversations`) and that the GGUF's chat template renders their prompts as HF's does, measure fidelity on the
    first `fidelity_dialogues`."""
    tokenizer = load_tokenizer(folder)
    entry: dict[str, Any] = {"gguf": str(out_file)}
    quant, keep_f16 = check_quant(config.quant), config.keep_f16
    text = calibration_text(folder, calibration)
    texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]
    compared = text is not None and bool(texts[: config.fidelity_dialogues])  # weighted and plain, by fidelity
    f16 = out_file.with_name(out_file.stem + ".f16.gguf")
    try:  # the F16 is kept for the plain quantization too, then removed unless asked for
        export_model(folder, out_file, quant, keep_f16=keep_f16 or compared, calibration=text, report=entry)
        entry |= {
            "bytes": out_file.stat().st_size,
            "tokenizer_strings_checked": check_tokenizer(tokenizer, out_file, texts),
            "template_prompts_checked": check_template(tokenizer, out_file, conversations),
        }
        if keep_f16 and f16.is_file():
            entry["f16_bytes"] = f16.stat().st_size
        if texts[: config.fidelity_dialogues]:
            entry["fidelity"] = fidelity(folder, out_file, texts[: config.fidelity_dialogues])
            if "imatrix" in entry:
                keep_the_closer(folder, f16, out_file, quant, texts[: config.fidelity_dialogues], entry)
    finally:
        if not keep_f16:
            f16.unlink(missing_ok=True)
    return entry


def closeness(figures: dict[str, Any]) -> tuple[float, float]:
    """How close a GGUF is to its HF weights: top-1 agreement first, then perplexity (lower is closer)."""
    return figures["top1_agreement"], -figures["perplexity_gguf"]


def keep_the_closer(
    folder: Path, f16: Path, weighted: Path, quant: str, texts: list[str], entry: dict[str, Any]
) -> None:
    """The importance matrix is not better everywhere (measured: a tuned Qwen 0.5B draft at Q5_K_M, the demo target
    at Q4_K_M): quantize the same F16 plainly too and keep whichever file is closer to the HF weights on the held-out
    `texts`, saying so in `entry` (its fidelity the kept file's, the other's beside it)."""
    plain = scratch_path(weighted, "plain")
    try:
        quantize(f16, plain, quant)
        plain_fidelity = fidelity(folder, plain, texts)
        kept = closeness(entry["fidelity"]) >= closeness(plain_fidelity)
        entry["imatrix"] |= {"kept": kept, "plain_fidelity": plain_fidelity, "weighted_fidelity": entry["fidelity"]}
        if not kept:
            os.replace(plain, weighted)
            entry["fidelity"] = plain_fidelity
    finally:
        plain.unlink(missing_ok=True)


def calibration_text(folder: Path, dialogues: list[list[dict[str, str]]]) -> str | None:
    """The text a model's importance matrix is computed on: `dialogues` rendered with its own chat template (None
    without any). The same dialogues give the same text, so the matrix cache serves every type of one model."""
    tokenizer = load_tokenizer(folder)
    return "\n".join(tokenizer.apply_chat_template(messages, tokenize=False) for messages in dialogues) or None


def matrix_use(config: ExportPairConfig) -> tuple[bool, str]:
    """Whether this export quantizes with importance matrices, and why (what export.json and the stage say)."""
    if config.imatrix == "off" or config.calibration_data is None:
        return False, "imatrix off" if config.imatrix == "off" else "no training dialogues to compute it on"
    if config.imatrix == "auto" and not all(tool_path(tool).is_file() for tool in (IMATRIX_TOOL, QUANTIZE_TOOL)):
        return False, "llama.cpp's tools are not built (`spectune tools build-llama-cpp`, or export.imatrix: on)"
    build_llama_cpp()  # cached where built
    return True, f"computed on {config.calibration_data}"


def held_out(data: Path | None, n: int) -> list[list[dict[str, str]]]:
    """The first `n` dialogues' messages of a dataset (none without one)."""
    return [] if data is None else [d.messages for d in read_dialogues(data).dialogues[:n]]


def export_pair(config: ExportPairConfig) -> dict[str, Any]:
    """`spectune export-pair`: the GGUFs and their checks (export_models), then the pair to serve (pair.json, at the
    acceptance report's choice where given) and llama.cpp's server command for it (llama-server.sh)."""
    report = export_models(config)
    acceptance = json.loads(config.acceptance.read_text()) if config.acceptance else None
    return report | write_pair(config, acceptance)


def export_models(config: ExportPairConfig) -> dict[str, Any]:
    """Export the target and its drafts, check each pair and the tokenizer, report fidelity (export.json)."""
    quant = check_quant(config.quant)
    drafts = {name: resolve_model(path) for name, path in config.drafts.items()}
    config = config.model_copy(update={"target": resolve_model(config.target), "drafts": drafts})
    conversations = held_out(config.data, max(TOKENIZER_DIALOGUES, config.fidelity_dialogues))
    use_matrix, why = matrix_use(config)
    calibration = held_out(config.calibration_data, CALIBRATION_DIALOGUES) if use_matrix else []
    target_file = config.out / gguf_name(TARGET, quant)
    report: dict[str, Any] = {
        "quant": quant,
        "imatrix": {"used": use_matrix, "why": why},
        "models": {TARGET: export_checked(config, config.target, target_file, conversations, calibration)},
        "pairs": {},
    }
    for name, folder in config.drafts.items():
        draft_file = config.out / gguf_name(name, quant)
        if is_head(folder):  # drafts only beside the target, checked with it: no standalone model to compare
            # an EAGLE-3 head's tokenizer and config are its target's; an MTP assistant carries its own
            head_target = config.target if is_eagle3_head(folder) else None
            export_model(folder, draft_file, quant, keep_f16=config.keep_f16, target_model_dir=head_target)
            kind = "eagle3" if head_target else "mtp"
            report["models"][name] = {"gguf": str(draft_file), "bytes": draft_file.stat().st_size, kind: True}
        else:
            report["models"][name] = export_checked(config, folder, draft_file, conversations, calibration)
        report["pairs"][name] = check_pair(target_file, draft_file)
    with atomic_path(config.out / EXPORT_REPORT) as tmp:
        tmp.write_text(json.dumps(report, indent=2))
    return report


def write_pair(config: ExportPairConfig, acceptance: dict[str, Any] | None) -> dict[str, Any]:
    """pair.json and llama-server.sh for the exported GGUFs in `config.out`: the tuned draft to serve and its k
    (choose_draft); returns them as `chosen` and `llama_server`."""
    quant = check_quant(config.quant)
    target_file = config.out / gguf_name(TARGET, quant)
    variant, k = choose_draft(list(config.drafts), acceptance)
    name = variant.draft or ""
    swept = (acceptance or {}).get("draft_types", {}).get("drafts", {})  # the type chosen for each draft model
    draft_file = Path(swept[name]["gguf"]) if name in swept else config.out / gguf_name(name, quant)
    fronted = acceptance if acceptance and variant.lookups else None  # lookup in front: its settings and answers
    alone = [row for row in (fronted or {}).get("drafts", []) if row["name"] == name]  # the draft's own k
    chosen = ChosenPair(
        target=target_file,
        draft=draft_file,
        draft_name=name,
        k=k,
        draft_k=alone[0]["recommended_k"] if alone else None,
        ngram=fronted["ngram"] if fronted else None,
        ngram_data=fronted.get("ngram_data") if fronted else None,
        eagle3=is_eagle3_head(Path(config.drafts[name])),
        mtp=is_mtp_assistant(Path(config.drafts[name])),
        # The HF folders they came from: what vLLM and SGLang serve (`spectune export --for vllm|sglang`).
        target_hf=config.target,
        draft_hf=Path(config.drafts[name]),
    )
    # Run from the GGUFs' folder (llama-server.sh changes to it), as pair.json names them.
    command = server_command(
        SERVER,
        Path(target_file.name),
        Path(draft_file.name),
        DecodeSettings(draft_max=k),
        thread_count(config.threads),
        port=8080,
        lookups=chosen.variant.lookups,
        ngram=chosen.ngram,
        draft_type=spec_type(draft_file),
    )
    check_command(command)
    llama_server = shlex.join(command)
    chosen.write(config.out / CHOSEN_PAIR)
    with atomic_path(config.out / SERVER_SCRIPT) as tmp:
        tmp.write_text(
            f"#!/bin/sh\n# llama.cpp's own server on the tuned pair: {variant.name}, k = {k} (its recommended k).\n"
            "# GGML_CPU_TILED_MM=0, --no-repack and -fa off keep batched logits equal to one-token ones.\n"
            "# The GGUFs are named relative to this script's folder, so the run folder can move.\n"
            'cd "$(dirname "$0")" || exit 1\n'
            f'GGML_CPU_TILED_MM=0 exec {llama_server} "$@"\n'
        )
    return {"chosen": chosen.model_dump(mode="json"), "llama_server": llama_server}
