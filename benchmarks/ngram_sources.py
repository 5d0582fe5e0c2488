"""Which n-gram source foretells the tuned target: at every position of the target's own greedy answers to held-out
prompts, does the conversation's table, the domain table (the target's answers to training dialogues), or both,
propose a next token, and is it the target's? Offline (no verification timed): it shows what a lookup can give
before the bench times what it does give.

Usage: python benchmarks/ngram_sources.py --run benchmarks/runs/demo --domain ANSWERS.jsonl --name demo [--n 60]
Writes benchmarks/results/ngram_sources_NAME.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

from spectune.data.prepare import read_prompts
from spectune.data.read import assistant_turns
from spectune.layout import TARGET, RunLayout
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.ngram import NgramDrafter, NgramSettings, domain_table
from spectune.runtime.speculative import SpeculativeDecoder

SOURCES = {
    "conversation": {"domain": False},
    "domain": {"context": False},
    "domain, then conversation": {},
}


def first_token_hits(
    drafter: NgramDrafter, target: LlamaModel, answers: list[tuple[list[int], list[int]]]
) -> dict[str, int]:
    """Positions where the lookup proposed, and where its first token was the target's next."""
    proposed = right = 0
    for prompt, answer in answers:
        for position in range(len(answer)):
            proposal = drafter.propose(prompt + answer[:position], 1, target.is_end)
            proposed += bool(proposal.tokens)
            right += proposal.tokens == answer[position : position + 1]
    return {"positions": sum(len(answer) for _, answer in answers), "proposed": proposed, "right": right}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="A finished run folder (its target GGUF and eval).")
    parser.add_argument("--domain", type=Path, required=True, help="Chat JSONL of the target's own answers.")
    parser.add_argument("--name", required=True)
    parser.add_argument("--n", type=int, default=60, help="Held-out prompts.")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    layout = RunLayout(args.run)
    target = LlamaModel(layout.gguf(TARGET), n_ctx=4096, threads=None)
    decoder = SpeculativeDecoder(target)
    answers = []
    for prompt in read_prompts(layout.eval_file)[: args.n]:
        ids = target.tokenize(chat_prompt(target, prompt.messages))
        answers.append((ids, decoder.generate(ids, DecodeSettings(max_tokens=args.max_tokens)).tokens))
    domain_answers = [target.tokenize(text, special=False) for text in assistant_turns(args.domain)]
    rows = {}
    for label, values in SOURCES.items():
        settings = NgramSettings(**values)
        drafter = NgramDrafter(settings, domain_table(settings, domain_answers))
        rows[label] = first_token_hits(drafter, target, answers)
    print(f"{args.name}: {len(answers)} prompts, {len(domain_answers)} domain answers, defaults {NgramSettings()}")
    print("| source | positions | proposed | first token right |\n|---|---|---|---|")
    for label, row in rows.items():
        share = row["right"] / row["proposed"] if row["proposed"] else 0.0
        print(f"| {label} | {row['positions']} | {row['proposed']} | {row['right']} ({share:.1%}) |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = Path(__file__).parent / "results" / f"ngram_sources_{args.name}.json"
    record = {
        "command": f"python benchmarks/ngram_sources.py --run {args.run} --domain {args.domain} --name {args.name} "
        f"--n {args.n} --max-tokens {args.max_tokens}",
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "prompts": len(answers),
        "domain_answers": len(domain_answers),
        "settings": NgramSettings().model_dump(),
        "sources": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
