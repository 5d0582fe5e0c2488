"""Does merging change the tuned target's answers? Greedy answers on held-out prompts from three forms of a finished
run's target: the model as trained (the 4-bit NF4 base + the LoRA adapter), the adapter on the unquantized base
(what `merge` folds), and the merged folder that export converts. Counts identical answers and where the first
differing token falls.

Usage: python benchmarks/merge_check.py runs/gemma3-sgd --name gemma3_270m_sgd [--n 20 --max-new-tokens 48]
Writes benchmarks/results/merge_check_NAME.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from peft import PeftModel
from pipeline_run import write_result
from transformers import AutoModelForCausalLM

from spectune.data.prepare import extract_prompts
from spectune.data.read import read_dialogues
from spectune.layout import RunLayout
from spectune.models.load import load_tokenizer
from spectune.threads import configure_torch_threads
from spectune.train.common import greedy_answer
from spectune.train.target import load_base


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first differing token (the shorter answer's length if one is a prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    configure_torch_threads()
    layout = RunLayout(args.run)
    manifest = json.loads(layout.manifest.read_text())
    base = Path(manifest["stages"]["target"]["outputs"]["target"])
    adapter = layout.target_dir / "adapter"
    tokenizer = load_tokenizer(layout.merged_target)
    prompts = extract_prompts(read_dialogues(layout.eval_file).dialogues, args.n, seed=1)
    forms = {
        "nf4_base_plus_adapter": lambda: PeftModel.from_pretrained(load_base(base, four_bit=True), str(adapter)),
        "f32_base_plus_adapter": lambda: PeftModel.from_pretrained(load_base(base, four_bit=False), str(adapter)),
        "merged": lambda: AutoModelForCausalLM.from_pretrained(layout.merged_target, dtype=torch.float32),
    }
    answers = {}
    for form, load in forms.items():
        model = load().eval()
        answers[form] = [greedy_answer(model, tokenizer, p.messages, args.max_new_tokens)[1] for p in prompts]
        del model
    report = {"run": str(args.run), "base": str(base), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    for form in ("nf4_base_plus_adapter", "f32_base_plus_adapter"):
        differences = [first_difference(a, b) for a, b in zip(answers[form], answers["merged"], strict=True)]
        report[f"merged_vs_{form}"] = {
            "identical": sum(d is None for d in differences),
            "first_difference_at_token": [d for d in differences if d is not None],
        }
        print(form, "vs merged:", report[f"merged_vs_{form}"])
    write_result(f"merge_check_{args.name}.json", report)


if __name__ == "__main__":
    main()
