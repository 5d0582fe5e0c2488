"""Gemma 3 against llama.cpp on every SGD dev dialogue: tokenizer identity (every turn's text and every dialogue
rendered with the system prompt) and chat-template identity (every prompt up to an assistant turn, the system prompt
folded by Gemma's own template), for the GGUF the model came in and for spectune's export of the imported folder,
plus that export's fidelity. Needs `spectune models fetch gemma3-270m` (user cache; Gemma terms of use).

Usage: python benchmarks/gemma3_checks.py --data ../shared/data/sgd/dev.jsonl --export /tmp/gemma.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipeline_run import write_result

from spectune.data.read import read_dialogues
from spectune.export.pair import fidelity
from spectune.models.imported import fetch
from spectune.models.load import load_tokenizer
from spectune.models.tokenizer_check import template_mismatches, tokenizer_mismatches
from spectune.runtime.build import gguf_field

SYSTEM = "You are a phone assistant that helps callers book, find and pay for things. Answer briefly."


def check(tokenizer, gguf: Path, turns: list[str], rendered: list[str], conversations: list) -> dict:
    """Tokenizer identity, and template identity where the GGUF carries a template (base checkpoints do not)."""
    start = time.perf_counter()
    token_mismatches = tokenizer_mismatches(tokenizer, gguf, turns + rendered)
    has_template = gguf_field(gguf, "tokenizer.chat_template") is not None
    prompt_mismatches = template_mismatches(tokenizer, gguf, conversations) if has_template else []
    prompts = sum(m["role"] == "assistant" for messages in conversations for m in messages) if has_template else 0
    return {
        "gguf": str(gguf),
        "tokenizer_strings": len(turns) + len(rendered),
        "tokenizer_mismatches": len(token_mismatches),
        "tokenizer_mismatch_examples": token_mismatches[:5],
        "template_prompts": prompts,
        "template_mismatches": len(prompt_mismatches),
        "template_mismatch_examples": prompt_mismatches[:5],
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/sgd/dev.jsonl"))
    parser.add_argument("--export", type=Path, required=True, help="spectune export of the imported folder")
    parser.add_argument("--fidelity-dialogues", type=int, default=10)
    args = parser.parse_args()
    folder = fetch("gemma3-270m")
    tokenizer = load_tokenizer(folder)
    source = Path(json.loads((folder / "spectune_import.json").read_text())["source"])
    conversations = [[{"role": "system", "content": SYSTEM}, *d.messages] for d in read_dialogues(args.data).dialogues]
    turns = [m["content"] for messages in conversations for m in messages]
    rendered = [tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]
    report = {
        "model": "gemma3-270m",
        "data": str(args.data),
        "dialogues": len(conversations),
        "system_prompt": SYSTEM,
        "as_shipped": check(tokenizer, source, turns, rendered, conversations),
        "exported": check(tokenizer, args.export, turns, rendered, conversations),
        "export_fidelity": fidelity(folder, args.export, rendered[: args.fidelity_dialogues]),
    }
    print(json.dumps(report, indent=2))
    write_result("gemma3_checks_sgd.json", report)


if __name__ == "__main__":
    main()
