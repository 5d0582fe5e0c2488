"""`spectune export --for vllm|sglang RUN_DIR`: the finished run's merged target and chosen draft as HF folders
(those engines serve HF checkpoints, not GGUF) and the engine's command with the run's k.

The flags were checked against the engines' own argument definitions (benchmarks/engine_args.py parses the
written command with them): vLLM 0.33.0 (`vllm serve --speculative-config` JSON, vllm/config/speculative.py:
method "draft_model" or "eagle3", model, num_speculative_tokens) and SGLang 0.5.23
(sglang/srt/arg_groups/fields/spec.py: STANDALONE or EAGLE3 with eagle-topk 1, whose num-draft-tokens must be
num-steps + 1).

An EAGLE-3 head is handed off in the layout both engines load (LlamaForCausalLMEagle3: `midlayer.*`, `fc`, `d2t`
as offsets, no embedding of its own), read from their sources: vLLM's model_executor/models/llama_eagle3.py and
SGLang's srt/models/llama_eagle3.py. They differ on the target layers: vLLM reads the head's top-level
`eagle_aux_hidden_state_layer_ids` as the inputs of those layers (as spectune trains and llama.cpp runs them);
SGLang reads only `eagle_config`'s and captures one layer later (the output of layer i: its models' "val + 1"), so
its copy of the head's config says each layer minus one.

A Gemma 4 MTP assistant goes to vLLM as `{"method": "mtp", "model": ASSISTANT}`: vLLM 0.33.0's
vllm/config/speculative.py turns a `gemma4_assistant` or `gemma4_unified_assistant` config into its `gemma4_mtp`
drafter (one draft token per forward, the target's KV shared by its proposer). SGLang's support for it was not
checked: refused there.
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
# The targets each engine runs an EAGLE-3 head beside: its models that capture layer inputs for one (vLLM's classes
# that implement SupportsEagle3, SGLang's that define set_eagle3_layers_to_capture), of the families spectune tunes.
HEAD_TARGETS = {
    "vllm": ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    "sglang": ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"),
}
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


def engine_command(
    engine: Engine, target: Path, draft: Path, k: int, host: str, port: int, name: str, head: str | None = None
) -> list[str]:
    """The command that serves `target` with `draft` (a head where `head` names its kind: eagle3, or mtp for a
    Gemma 4 assistant, which vLLM alone takes here) proposing `k` tokens a step, greedy-verifiable."""
    eagle3 = head == "eagle3"
    if engine == "vllm":
        method = head or "draft_model"
        speculative = {"method": method, "model": str(draft), "num_speculative_tokens": k}
        return ["vllm", "serve", str(target), "--served-model-name", name, "--host", host, "--port", str(port),
                "--speculative-config", json.dumps(speculative)]  # fmt: skip
    return ["python", "-m", "sglang.launch_server", "--model-path", str(target), "--served-model-name", name,
            "--host", host, "--port", str(port), "--speculative-algorithm", "EAGLE3" if eagle3 else "STANDALONE",
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


def head_layers(engine: Engine, target: Path, head: Path) -> list[int]:
    """The target layers whose inputs an EAGLE-3 head reads, checked that `engine` runs a head beside this target."""
    architectures = json.loads((target / "config.json").read_text()).get("architectures") or []
    if not set(architectures) & set(HEAD_TARGETS[engine]):
        raise SpectuneError(
            f"{target}: {engine} {CHECKED_AGAINST[engine]} runs EAGLE-3 heads beside {', '.join(HEAD_TARGETS[engine])}"
            f", not {', '.join(architectures) or 'this model'}; serve the head with the run's llama-server.sh (or "
            "spectune serve)"
        )
    layers = json.loads((head / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids") or []
    if not layers:
        raise SpectuneError(f"{head / 'config.json'}: no eagle_aux_hidden_state_layer_ids (the layers the head reads)")
    if engine == "sglang" and min(layers) < 1:
        raise SpectuneError(f"{head}: SGLang cannot capture layer 0's input (the embedding) for an EAGLE-3 head")
    return layers


def sglang_head_config(draft: Path, layers: list[int]) -> None:
    """The handed-off head's config.json as SGLang reads its layers (each minus one: see the module's note). The file
    is a hard link to the run's: replaced, not edited."""
    config = json.loads((draft / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [layer - 1 for layer in layers]}
    (draft / "config.json").unlink()
    (draft / "config.json").write_text(json.dumps(config, indent=2))


def hand_off(config: HandoffConfig) -> dict[str, Any]:
    """Write OUT/target, OUT/draft, handoff.json and serve.sh; returns the report."""
    chosen = ChosenPair.read(RunLayout(config.run).chosen_pair)
    if chosen.mtp and config.engine != "vllm":
        raise SpectuneError(
            f"{config.run}: its draft is a Gemma 4 MTP assistant; handing one to {config.engine} is not checked "
            f"against {config.engine} {CHECKED_AGAINST[config.engine]}'s sources here: hand it to vllm, or serve it "
            "with llama-server.sh (draft-mtp) or `spectune serve`"
        )
    if chosen.target_hf is None or chosen.draft_hf is None:
        raise SpectuneError(f"{config.run}: its pair.json predates hand-off; run `spectune run CONFIG --only export`")
    target, draft = check_model_dir(str(chosen.target_hf)), check_model_dir(str(chosen.draft_hf))
    vocabulary = check_same_tokenizer(target, draft)  # a head's folder carries its target's tokenizer
    layers = head_layers(config.engine, target, draft) if chosen.eagle3 else None
    out = config.out or config.run / "handoff" / config.engine
    command = engine_command(
        config.engine, out / "target", out / "draft", chosen.alone_k, config.host, config.port, config.model_name,
        "eagle3" if chosen.eagle3 else "mtp" if chosen.mtp else None,
    )  # fmt: skip
    report = {
        "engine": config.engine,
        "checked_against": f"{config.engine} {CHECKED_AGAINST[config.engine]}",
        "draft_name": chosen.draft_name,
        "k": chosen.alone_k,
        "lookup_left_out": chosen.ngram is not None,  # neither engine chains n-gram lookup in front of a draft
        "eagle3": chosen.eagle3,
        "mtp": chosen.mtp,
        "head_layers": layers,
        "vocabulary": vocabulary,
        "from": {"target": str(target), "draft": str(draft)},
        "command": shlex.join(command),
    }
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        _link_tree(target, tmp / "target")
        _link_tree(draft, tmp / "draft")
        if layers is not None and config.engine == "sglang":
            sglang_head_config(tmp / "draft", layers)
        (tmp / HANDOFF_REPORT).write_text(json.dumps(report, indent=2))
        script = tmp / SERVE_SCRIPT
        kind = "EAGLE-3 head" if chosen.eagle3 else "MTP assistant" if chosen.mtp else "draft"
        script.write_text(
            f"#!/bin/sh\n# {config.engine} on the tuned pair: {kind} {chosen.draft_name}, k = {chosen.alone_k} "
            f"(its recommended k alone); flags checked against {report['checked_against']}.\n"
            f'exec {report["command"]} "$@"\n'
        )
        script.chmod(0o755)
    return report
