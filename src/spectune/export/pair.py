"""Export a target and its draft together, and check llama.cpp will accept them as a speculative pair,
that llama.cpp tokenizes exactly like HF, and how much the quantization changed the models."""

from __future__ import annotations

import json
import math
import random
import shlex
from pathlib import Path
from typing import Any

from spectune.atomic import atomic_path
from spectune.errors import SpectuneError
from spectune.runtime.llama import LlamaModel, VocabInfo, read_vocab

# llama.cpp's own rule for a draft (common/speculative.cpp): vocab sizes within 128, texts equal from id 5 on.
VOCAB_SIZE_SLACK = 128
FIRST_CHECKED_TOKEN = 5


def check_pair(target_gguf: Path, draft_gguf: Path) -> dict[str, Any]:
    """Refuse a pair llama.cpp would refuse, naming the first mismatch."""
    target, draft = read_vocab(target_gguf), read_vocab(draft_gguf)
    problems = _pair_problems(target, draft)
    if problems:
        raise SpectuneError(f"{draft_gguf} cannot draft for {target_gguf}: " + "; ".join(problems))
    return {
        "vocab_type": target.vocab_type,
        "target_tokens": target.n_tokens,
        "draft_tokens": draft.n_tokens,
        "bos": target.bos,
        "eos": target.eos,
    }


def _pair_problems(target: VocabInfo, draft: VocabInfo) -> list[str]:
    problems = []
    for field in ("vocab_type", "bos", "eos", "add_bos", "add_eos"):
        if getattr(target, field) != getattr(draft, field):
            problems.append(f"{field} differs (target {getattr(target, field)}, draft {getattr(draft, field)})")
    if abs(target.n_tokens - draft.n_tokens) > VOCAB_SIZE_SLACK:
        problems.append(f"vocab sizes differ by more than {VOCAB_SIZE_SLACK} ({target.n_tokens} vs {draft.n_tokens})")
    for token in range(FIRST_CHECKED_TOKEN, min(target.n_tokens, draft.n_tokens)):
        if target.texts[token] != draft.texts[token]:
            problems.append(f"token {token} differs: target {target.texts[token]!r}, draft {draft.texts[token]!r}")
            break
    return problems


def tokenizer_strings(n: int, seed: int = 0) -> list[str]:
    """Strings that stress a tokenizer: prose, code, digits, unicode, emoji, whitespace runs, chat markup."""
    from spectune.data.demo import generate_dialogues
    from spectune.models.corpus import EMOJI, GREETINGS, generate_corpus

    rng = random.Random(seed)
    turns = [t["content"] for d in generate_dialogues(100, seed=seed) for t in d.messages]
    pieces = [
        *generate_corpus(100, seed=seed),
        *turns,
        *GREETINGS,
        *EMOJI,
        "  ",
        "\n\n\n",
        "\t \t",
        "   x",
        "1234567890",
        "3.14159",
        "1,000,000",
        "don't",
        "I'VE",
        "ＡＢＣ",
        "e\u0301",
        "\u200d",
        "a  b   c",
        " leading",
        "trailing  ",
        "x\r\ny",
        "€£¥",
        "ğüşöç",
        "<|im_start|>user\n",
        "<|im_end|>\n",
    ]
    separators = ["", " ", "  ", "\n", "\t", "\n\n  "]
    return [
        "".join(rng.choice(pieces)[: rng.randint(1, 60)] + rng.choice(separators) for _ in range(rng.randint(1, 6)))
        for _ in range(n)
    ]


def check_tokenizer(hf_tokenizer: Any, gguf: Path, n: int = 2000) -> int:
    """llama.cpp must tokenize like HF (special tokens parsed by both); a mismatch is an error."""
    model = LlamaModel(gguf, n_ctx=64, threads=1)
    try:
        for text in tokenizer_strings(n):
            expected = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
            got = model.tokenize(text)
            if expected != got:
                raise SpectuneError(f"{gguf}: llama.cpp tokenizes {text!r} as {got[:20]}..., HF as {expected[:20]}...")
    finally:
        model.close()
    return n


def fidelity(hf_dir: Path, gguf: Path, texts: list[str], threads: int | None = None) -> dict[str, Any]:
    """Top-1 next-token agreement of a GGUF with the HF model, and the perplexity of each, on `texts`."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from spectune.models.load import load_tokenizer

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


def server_command(target: Path, draft: Path, threads: int, draft_max: int = 8) -> str:
    """The equivalent llama.cpp server command, for users who serve with llama.cpp's own server."""
    return " ".join(
        shlex.quote(part)
        for part in (
            "llama-server",
            "-m",
            str(target),
            "-md",
            str(draft),
            "--spec-type",
            "draft-simple",
            "--draft-max",
            str(draft_max),
            "--draft-min",
            "0",
            "--draft-p-min",
            "0.0",
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--no-repack",
            "--host",
            "127.0.0.1",
            "--port",
            "8080",
        )
    )


def export_checked(folder: Path, out_file: Path, quant: str, eval_texts: list[str] | None, keep_f16: bool) -> dict:
    """Export one model, check llama.cpp tokenizes like HF, and (given texts) measure fidelity."""
    from spectune.export.gguf import export_model
    from spectune.models.load import check_model_dir, load_tokenizer

    check_model_dir(folder)
    export_model(folder, out_file, quant, keep_f16=keep_f16)
    entry: dict[str, Any] = {
        "gguf": str(out_file),
        "bytes": out_file.stat().st_size,
        "tokenizer_strings_checked": check_tokenizer(load_tokenizer(folder), out_file),
    }
    f16 = out_file.with_name(out_file.stem + ".f16.gguf")
    if f16.is_file():
        entry["f16_bytes"] = f16.stat().st_size
    if eval_texts:
        entry["fidelity"] = fidelity(folder, out_file, eval_texts)
    return entry


def export_pair(
    target_dir: Path,
    draft_dirs: dict[str, Path] | Path,
    out_dir: Path,
    quant: str = "Q4_K_M",
    eval_texts: list[str] | None = None,
    keep_f16: bool = True,
) -> dict[str, Any]:
    """Export the target and its draft(s) to `quant`, check each pair and the tokenizer, report fidelity."""
    from spectune.export.gguf import check_quant
    from spectune.threads import thread_count

    quant = check_quant(quant)
    drafts = draft_dirs if isinstance(draft_dirs, dict) else {"draft": draft_dirs}
    target_file = out_dir / f"target.{quant}.gguf"
    report: dict[str, Any] = {
        "quant": quant,
        "models": {"target": export_checked(target_dir, target_file, quant, eval_texts, keep_f16)},
        "pairs": {},
    }
    for name, folder in drafts.items():
        draft_file = out_dir / f"{name}.{quant}.gguf"
        report["models"][name] = export_checked(folder, draft_file, quant, eval_texts, keep_f16)
        report["pairs"][name] = check_pair(target_file, draft_file)
    first = out_dir / f"{next(iter(drafts))}.{quant}.gguf"
    report["llama_server"] = server_command(target_file, first, thread_count())
    with atomic_path(out_dir / "export.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2))
    with atomic_path(out_dir / "llama-server.sh") as tmp:
        tmp.write_text(
            "#!/bin/sh\n# Serve this pair with llama.cpp's own server (speculative decoding).\n"
            f"exec {report['llama_server']}\n"
        )
    return report
