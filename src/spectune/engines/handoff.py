"""`spectune export --for vllm|sglang RUN_DIR`: the finished run's merged target and chosen draft as HF folders
(those engines serve HF checkpoints, not GGUF) and the engine's command with the run's k.

The flags were checked against the engines' own argument definitions (benchmarks/engine_args.py parses the
written command with them): vLLM 0.33.0 (`vllm serve --speculative-config` JSON, vllm/config/speculative.py:
method "draft_model", model, num_speculative_tokens) and SGLang 0.5.23 (sglang/srt/arg_groups/fields/spec.py:
STANDALONE with eagle-topk 1, whose num-draft-tokens must be num-steps + 1).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from spectune.atomic import atomic_path
from spectune.config import Settings
from spectune.errors import SpectuneError
from spectune.layout import RunLayout
from spectune.models.load import check_model_dir, load_tokenizer
from spectune.runtime.chosen import ChosenPair

CHECKED_AGAINST = {"vllm": "0.33.0", "sglang": "0.5.23"}
HANDOFF_REPORT, SERVE_SCRIPT = "handoff.json", "serve.sh"
Engine = Literal["vllm", "sglang"]


class HandoffConfig(Settings):
    """Everything `spectune export --for vllm|sglang` takes."""

    run: Path = Field(description="A finished `spectune run` folder (its pair.json names the pair and k).")
    engine: Engine = Field(description="The engine to hand the pair to.")
    out: Path | None = Field(None, description="Output folder (default RUN/handoff/ENGINE).")
    host: str = Field("127.0.0.1", description="Address the engine's server binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port the engine's server listens on.")
    model_name: str = Field("spectune", description="The model id the engine's API reports.")


def engine_command(engine: Engine, target: Path, draft: Path, k: int, host: str, port: int, name: str) -> list[str]:
    """The command that serves `target` with `draft` proposing `k` tokens a step, greedy-verifiable."""
    if engine == "vllm":
        speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
        return ["vllm", "serve", str(target), "--served-model-name", name, "--host", host, "--port", str(port),
                "--speculative-config", json.dumps(speculative)]  # fmt: skip
    return ["python", "-m", "sglang.launch_server", "--model-path", str(target), "--served-model-name", name,
            "--host", host, "--port", str(port), "--speculative-algorithm", "STANDALONE",
            "--speculative-draft-model-path", str(draft), "--speculative-num-steps", str(k),
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1)]  # fmt: skip


def check_same_tokenizer(target: Path, draft: Path) -> int:
    """Both engines verify the draft's token ids with the target: the vocabularies, special tokens and chat
    templates must be the same. Returns the vocabulary size."""
    tokenizers = {role: load_tokenizer(folder) for role, folder in (("target", target), ("draft", draft))}
    problems = [
        aspect
        for aspect, read in (
            ("vocabulary", lambda t: t.get_vocab()),
            ("special tokens", lambda t: t.special_tokens_map),
            ("chat template", lambda t: t.chat_template),
        )
        if read(tokenizers["target"]) != read(tokenizers["draft"])
    ]
    if problems:
        raise SpectuneError(f"{draft}: its tokenizer differs from the target's ({', '.join(problems)}): not a pair")
    return len(tokenizers["target"])


def _link_tree(source: Path, out: Path) -> None:
    """A copy that costs no disk where it can: hard links (a later retrain replaces files, never edits them)."""

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, out, copy_function=link_or_copy)


def hand_off(config: HandoffConfig) -> dict[str, Any]:
    """Write OUT/target, OUT/draft, handoff.json and serve.sh; returns the report."""
    chosen = ChosenPair.read(RunLayout(config.run).chosen_pair)
    if chosen.target_hf is None or chosen.draft_hf is None:
        raise SpectuneError(f"{config.run}: its pair.json predates hand-off; run `spectune run CONFIG --only export`")
    if chosen.eagle3:
        raise SpectuneError(
            f"{config.run}: its pair serves an EAGLE-3 head, whose hand-off to {config.engine} is not built or checked "
            "yet; serve it with the run's llama-server.sh (or spectune serve --engine llama.cpp)"
        )
    target, draft = check_model_dir(str(chosen.target_hf)), check_model_dir(str(chosen.draft_hf))
    vocabulary = check_same_tokenizer(target, draft)
    out = config.out or config.run / "handoff" / config.engine
    command = engine_command(
        config.engine, out / "target", out / "draft", chosen.k, config.host, config.port, config.model_name
    )
    report = {
        "engine": config.engine,
        "checked_against": f"{config.engine} {CHECKED_AGAINST[config.engine]}",
        "draft_name": chosen.draft_name,
        "k": chosen.k,
        "vocabulary": vocabulary,
        "from": {"target": str(target), "draft": str(draft)},
        "command": shlex.join(command),
    }
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        _link_tree(target, tmp / "target")
        _link_tree(draft, tmp / "draft")
        (tmp / HANDOFF_REPORT).write_text(json.dumps(report, indent=2))
        script = tmp / SERVE_SCRIPT
        script.write_text(
            f"#!/bin/sh\n# {config.engine} on the tuned pair: draft {chosen.draft_name}, k = {chosen.k} "
            f"(the run's recommended k); flags checked against {report['checked_against']}.\n"
            f'exec {report["command"]} "$@"\n'
        )
        script.chmod(0o755)
    return report
