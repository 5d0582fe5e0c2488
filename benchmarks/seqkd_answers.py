"""seqkd's slow part, both ways on the same prompts: the tuned target's greedy answers from HF generate (f32) and
from llama.cpp (its Q8_0 export; `drafts.answers_by: llama.cpp` answers at the served type), interleaved prompt by
prompt. Prints tokens/s each way (totals and the per-prompt median) and how often the answers agree.
Needs a pipeline run whose merge stage finished; the prompts are the first assistant turns of its eval dialogues.

Usage: python benchmarks/seqkd_answers.py configs/smollm2-sgd.yaml --name smollm2_sgd --prompts 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from pipeline_run import RESULTS
from transformers import AutoModelForCausalLM, AutoTokenizer

from spectune.data.read import read_dialogues
from spectune.export.gguf import export_model
from spectune.pipeline.config import load_run_config
from spectune.runtime.chat import chat_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.train.common import greedy_answer
from spectune.train.draft import conversation_prompts


def hf_run(model: torch.nn.Module, tokenizer: AutoTokenizer, messages: list, max_new_tokens: int) -> tuple:
    """(answer text, generated tokens, seconds) with HF generate; the end token is not counted."""
    start = time.perf_counter()
    _, answer_ids = greedy_answer(model, tokenizer, messages, max_new_tokens)
    seconds = time.perf_counter() - start
    if answer_ids and answer_ids[-1] == tokenizer.eos_token_id:
        answer_ids = answer_ids[:-1]
    return tokenizer.decode(answer_ids, skip_special_tokens=True).strip(), len(answer_ids), seconds


def llama_run(decoder: SpeculativeDecoder, messages: list, max_new_tokens: int) -> tuple:
    """(answer text, generated tokens, seconds) with llama.cpp, prompt processing included as for HF. Each prompt
    starts from an empty cache: seqkd reuses a dialogue's prefix, which would flatter llama.cpp here."""
    decoder.forget()
    start = time.perf_counter()
    generation = decoder.generate(chat_tokens(decoder.target, messages), DecodeSettings(max_tokens=max_new_tokens))
    return generation.text.strip(), len(generation.tokens), time.perf_counter() - start


def summarize(runs: list[tuple]) -> dict:
    tokens, seconds = sum(r[1] for r in runs), sum(r[2] for r in runs)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(tokens / seconds, 1),
        "median_prompt_tokens_per_second": round(statistics.median(r[1] / r[2] for r in runs if r[1]), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--name", required=True, help="suffix of the result files")
    parser.add_argument("--prompts", type=int, default=40)
    args = parser.parse_args()
    config = load_run_config(args.config)
    layout, max_new_tokens = config.layout, config.drafts.max_tokens
    torch.set_num_threads(config.threads or 2)
    dialogues = read_dialogues(layout.eval_file).dialogues
    prompts = conversation_prompts(dialogues)[: args.prompts]
    model = AutoModelForCausalLM.from_pretrained(layout.merged_target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(layout.merged_target)
    with tempfile.TemporaryDirectory() as scratch:
        gguf = export_model(layout.merged_target, Path(scratch) / "target.Q8_0.gguf", "Q8_0")
        decoder = SpeculativeDecoder(LlamaModel(gguf, n_ctx=4096, threads=config.threads, exact=False))
        llama_run(decoder, prompts[0], max_new_tokens)  # warm-up
        hf, llama = [], []
        for messages in prompts:
            hf.append(hf_run(model, tokenizer, messages, max_new_tokens))
            llama.append(llama_run(decoder, messages, max_new_tokens))
    identical = sum(h[0] == g[0] for h, g in zip(hf, llama, strict=True))
    hf_summary, llama_summary = summarize(hf), summarize(llama)
    result = {
        "target": str(layout.merged_target),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "threads": config.threads,
        "hf_f32": hf_summary,
        "llama_cpp_q8_0": llama_summary,
        "identical_answers": identical,
        "speedup_llama_cpp_over_hf": round(llama_summary["tokens_per_second"] / hf_summary["tokens_per_second"], 2),
        "differing": [{"hf": h[0], "llama.cpp": g[0]} for h, g in zip(hf, llama, strict=True) if h[0] != g[0]][:5],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"seqkd_answers_{args.name}.json").write_text(json.dumps(result, indent=2))
    print(f"{'':12}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'median tok/s':>14}")
    for label, key in (("HF f32", "hf_f32"), ("llama.cpp", "llama_cpp_q8_0")):
        row = result[key]
        print(
            f"{label:12}{row['tokens']:>8}{row['seconds']:>9}{row['tokens_per_second']:>8}"
            f"{row['median_prompt_tokens_per_second']:>14}"
        )
    print(f"identical answers: {identical}/{len(prompts)}; llama.cpp {result['speedup_llama_cpp_over_hf']}x HF")


if __name__ == "__main__":
    main()
