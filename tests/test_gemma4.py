"""Gemma 4 and its MTP assistant: the demo world's micro pair built offline, the target QLoRA-tuned, the assistant
retuned for it, both converted by llama.cpp's converter; llama.cpp's `draft-mtp` and spectune's loop give the target
alone's answers, and accept what the offline meter's replay of the assistant in torch says."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TRAIN, running, tuned
from test_serve import engine_answer

from spectune.acceptance.meter import head_chains, simulate_tau
from spectune.acceptance.stage import load_models
from spectune.bench.llama_cpp_loop import llama_baseline, run_peer
from spectune.config import validate
from spectune.data.prepare import read_prompts
from spectune.engines.handoff import HandoffConfig, hand_off
from spectune.engines.llama_cpp import SERVER, SPECULATIVE_TOOL, build_llama_cpp
from spectune.engines.llama_server import free_port
from spectune.errors import SpectuneError
from spectune.export.gguf import export_model
from spectune.export.pair import ExportPairConfig, export_pair
from spectune.models.gemma4_pair import build_gemma4_pair
from spectune.models.mtp_assistant import check_fit, fit_problems
from spectune.pipeline.config import RunConfig, demo_config
from spectune.pipeline.stages import Context, target_stage
from spectune.runtime.chat import chat_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel, spec_type
from spectune.runtime.registry import Variant
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.serve.config import ServeConfig
from spectune.serve.engine import start_llama_server
from spectune.train.assistant import AssistantConfig, train_assistant
from spectune.train.common import greedy_answer

PROMPTS = 4
MAX_TOKENS = 48

TARGET = {
    "model_type": "gemma4_text",
    "hidden_size": 128,
    "vocab_size": 2048,
    "head_dim": 64,
    "global_head_dim": 128,
    "num_key_value_heads": 2,
    "layer_types": ["sliding_attention", "full_attention"],
}
ASSISTANT = {
    "model_type": "gemma4_assistant",
    "backbone_hidden_size": 128,
    "text_config": {**TARGET, "hidden_size": 64, "num_hidden_layers": 2, "num_kv_shared_layers": 2},
}


def test_an_assistant_that_cannot_read_the_targets_cache_is_refused_naming_both_files_and_the_mismatch():
    assert fit_problems(TARGET, ASSISTANT) == []
    wrong = {**ASSISTANT, "backbone_hidden_size": 256, "text_config": {**ASSISTANT["text_config"], "vocab_size": 4096}}
    with pytest.raises(SpectuneError) as caught:
        check_fit(Path("t"), TARGET, Path("a"), wrong)
    message = str(caught.value)
    assert "a cannot draft for t" in message
    assert "backbone_hidden_size 256, the target's hidden_size 128" in message and "vocab_size 4096" in message
    narrower = {**ASSISTANT, "text_config": {**ASSISTANT["text_config"], "head_dim": 32}}
    assert fit_problems(TARGET, narrower) == ["head_dim 32, the target's 64 (it reads the target's cache)"]
    one_kind = {**ASSISTANT, "text_config": {**ASSISTANT["text_config"], "layer_types": ["full_attention"]}}
    assert "layer types ['full_attention']" in fit_problems(TARGET, one_kind)[0]  # llama.cpp would abort on it
    assert "not a Gemma 4 model" in fit_problems({"model_type": "llama"}, ASSISTANT)[0]
    assert "not gemma4_assistant" in fit_problems(TARGET, {"model_type": "llama"})[0]


def test_a_run_whose_assistant_cannot_read_its_target_stops_at_the_target_stage(tmp_path):
    """Before any training: the run's own target and assistant folders, checked as the assistant stage would."""
    for name, config in (("target", TARGET), ("assistant", {**ASSISTANT, "backbone_hidden_size": 256})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        (tmp_path / name / "model.safetensors").write_bytes(b"")  # what a model folder has; never read
    values = {
        "run_dir": str(tmp_path / "run"),
        "models": {"target": str(tmp_path / "target"), "draft": str(tmp_path / "assistant")},
        "drafts": {"methods": [], "assistant": {}},
    }
    config = validate(RunConfig, values, "run.yaml")
    with pytest.raises(SpectuneError, match="backbone_hidden_size 256, the target's hidden_size 128"):
        target_stage(Context(config, config.layout, {}))
    with pytest.raises(SpectuneError, match="cannot draft for"):  # `spectune assistant` alike, nothing written
        train_assistant(
            AssistantConfig(
                target=tmp_path / "target", assistant=tmp_path / "assistant", data=tmp_path / "x", out=tmp_path / "out"
            )
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["Gemma4", "Gemma4Unified"])  # the 12B's assistant is the unified one
def test_every_anchor_at_once_drafts_as_transformers_assistant_does_from_one(family):
    """The batched drafting step (all anchors, one causal mask over the target's keys) gives, at each anchor, the
    logits transformers' assistant gives when assisted generation calls it from that anchor alone: the target's
    keys cut after it, (embedding, state) in, at the next position; and so on along the chain."""
    import torch
    import transformers

    from spectune.models.mtp_assistant import fit_problems, target_states, unroll

    Gemma4TextConfig, Gemma4ForCausalLM = (getattr(transformers, f"{family}{n}") for n in ("TextConfig", "ForCausalLM"))
    Gemma4AssistantConfig, Gemma4AssistantForCausalLM = (
        getattr(transformers, f"{family}Assistant{n}") for n in ("Config", "ForCausalLM")
    )

    shape = {"vocab_size": 97, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32}
    shape |= {"vocab_size_per_layer_input": 0, "hidden_size_per_layer_input": 0, "sliding_window": 64}
    layers = {"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2}
    torch.manual_seed(0)
    target = Gemma4ForCausalLM(
        Gemma4TextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, **shape, **layers)
    ).eval()
    text = Gemma4TextConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_kv_shared_layers=2, **shape, **layers
    )
    assistant = Gemma4AssistantForCausalLM(
        Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, use_ordered_embeddings=False)
    ).eval()
    assert fit_problems(target.config.to_dict(), assistant.config.to_dict()) == []
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    states = target_states(target, ids)
    with torch.no_grad():
        batched = unroll(assistant, states, ids, 2, 64)
        for anchor in (0, 5, 9):
            kv = {kind: (k[:, :, : anchor + 1], v[:, :, : anchor + 1]) for kind, (k, v) in states.kv.items()}
            state, token = states.hidden[:, anchor : anchor + 1], ids[:, anchor + 1 : anchor + 2]
            for step in range(2):
                embeds = torch.cat([target.get_input_embeddings()(token), state], dim=-1)
                out = assistant(inputs_embeds=embeds, position_ids=torch.tensor([[anchor + 1]]), shared_kv_states=kv)
                torch.testing.assert_close(out.logits[0, 0], batched[step][0, anchor], rtol=1e-4, atol=1e-4)
                state, token = out.last_hidden_state, ids[:, anchor + 2 + step : anchor + 3 + step]


def test_a_gemma4_demo_trains_only_its_assistant():
    config = demo_config("gemma4-demo")
    assert config.drafts.methods == [] and config.drafts.assistant is not None
    assert config.run_dir == Path("runs/gemma4-demo")
    with pytest.raises(SpectuneError, match=r"drafts\.methods"):  # sft cannot train an assistant
        validate(RunConfig, {"models": {"size": "gemma4-micro"}, "drafts": {"methods": ["sft"]}}, "run.yaml")


def test_the_gemma4_tokenizer_tokenizes_as_llama_cpp_does(gemma4_pair, tmp_path):
    """SentencePiece-style BPE with byte fallback: the same ids in HF and in llama.cpp's `gemma4` tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gemma4_pair / "target"))
    model = LlamaModel(export_model(gemma4_pair / "target", tmp_path / "t.gguf", "F32"), n_ctx=256, threads=1)
    texts = ["Hello there, I'd like a table for 2 at 7pm.", "  two  spaces\n\nand lines\n", "Grüße ☃ 你好 🙂", ""]
    texts += [
        turn["content"]
        for d in read_prompts(Path(__file__).parent / "data" / "sgd_dev_sample.jsonl")
        for turn in d.messages
    ]
    for text in texts:
        assert model.tokenize(text, special=False) == tokenizer(text, add_special_tokens=False)["input_ids"], text
    assert model.adds_bos  # llama.cpp's gemma4 vocabulary always adds <bos>; the chat template writes it itself


@pytest.fixture(scope="module")
def gemma4_pair(tmp_path_factory) -> Path:
    return build_gemma4_pair("gemma4-micro", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tuned_gemma4(gemma4_pair, demo_data, tmp_path_factory) -> Path:
    return tuned(gemma4_pair / "target", demo_data, tmp_path_factory.mktemp("gemma4-target"))


@pytest.fixture(scope="module")
def retuned(gemma4_pair, tuned_gemma4, demo_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("assistant")
    config = AssistantConfig(
        target=tuned_gemma4, assistant=gemma4_pair / "draft", data=demo_data, out=out, max_steps=30, lr=3e-3, **TRAIN
    )
    result = train_assistant(config)
    assert result.accuracy_after[0] > result.accuracy_before[0]  # it learnt the tuned target's tokens
    assert json.loads((out / "assistant.json").read_text())["result"]["steps"] == 30
    return result.model


def replayed(assistant: Any, target: Any, tokenizer: Any, messages: list[dict[str, str]], tokens: int) -> int:
    """The drafted tokens the meter's replay of the assistant accepts on the target's first `tokens` answer tokens."""
    ids, answer = greedy_answer(target, tokenizer, messages, tokens)
    chains = head_chains(assistant, target, ids, answer)
    replay = simulate_tau([[False] * len(answer)], 3, chains=lambda index, position: chains[position])
    return sum(replay.accepted)


def test_the_retuned_assistant_drafts_in_llama_cpp_and_spectunes_loop_with_the_target_alones_answers(
    gemma4_pair, tuned_gemma4, retuned, demo_data, tmp_path
):
    """F32 GGUFs: every answer is the target alone's in llama.cpp's draft-mtp and in spectune's loop, and llama.cpp
    accepts, prompt by prompt, what the meter's replay of the assistant in torch says (but for guesses after the end
    token, which llama.cpp drafts on and counts)."""
    target_gguf = export_model(tuned_gemma4, tmp_path / "target.gguf", "F32")
    assistant_gguf = export_model(retuned, tmp_path / "assistant.gguf", "F32")
    assert spec_type(assistant_gguf) == "draft-mtp" and spec_type(target_gguf) == "draft-simple"
    with pytest.raises(SpectuneError, match="MTP assistant: it runs only beside its target"):
        LlamaModel(assistant_gguf, threads=1)
    target, models, heads, tokenizer = load_models(tuned_gemma4, {"assistant": retuned})
    assert not models and list(heads) == ["assistant"]
    tool = build_llama_cpp() / SPECULATIVE_TOOL
    ours_target = LlamaModel(target_gguf, n_ctx=1024, threads=1)
    ours = SpeculativeDecoder(
        ours_target,
        Variant(draft="assistant").speculators(
            ours_target, LlamaModel(assistant_gguf, n_ctx=1024, threads=1, beside=ours_target), {}
        ),
    )
    alone_ours = SpeculativeDecoder(LlamaModel(target_gguf, n_ctx=1024, threads=1))
    accepted = ours_accepted = 0
    with llama_baseline(target_gguf, 1, 1024, exact=True) as alone:
        for prompt in read_prompts(demo_data)[-PROMPTS:]:
            text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
            run = run_peer(tool, target_gguf, assistant_gguf, text, 3, MAX_TOKENS, 1, 1024, exact=True)
            assert run.text == alone(text, MAX_TOKENS).text  # answers end first (the tool may overshoot -n)
            tokens = chat_tokens(ours_target, prompt.messages)
            generation = ours.generate(tokens, DecodeSettings(max_tokens=MAX_TOKENS, draft_max=3))
            assert generation.tokens == alone_ours.generate(tokens, DecodeSettings(max_tokens=MAX_TOKENS)).tokens
            replay = replayed(heads["assistant"], target, tokenizer, prompt.messages, MAX_TOKENS)
            # llama.cpp drafts on past the end token and counts the guesses after it the target agrees with (up to
            # k - 1 at the last step); the replay ends with the answer
            assert replay <= run.accepted <= replay + 2
            accepted += run.accepted
            ours_accepted += generation.stats.accepted_as_llama_cpp
    assert accepted > 0  # the assistant guessed some of the tuned target's tokens, so acceptance was exercised
    # the same steps as llama.cpp's but where an end token is drafted: ours drafts nothing after it (up to k less)
    assert 0 < ours_accepted <= accepted and ours_accepted >= accepted - 3 * PROMPTS


def test_a_run_serving_the_assistant_serves_it_in_spectune_and_in_llama_server(
    tuned_gemma4, retuned, demo_data, tmp_path
):
    """export_pair exports the assistant beside the target (draft-mtp in llama-server.sh); spectune's server drafts
    with it and llama-server runs it, each answering as the target alone; vLLM is handed it as its `mtp` method, SGLang
    refused with what to run instead."""
    from openai import OpenAI

    gguf = tmp_path / "run" / "gguf"
    config = ExportPairConfig(target=tuned_gemma4, drafts={"assistant": retuned}, out=gguf, data=demo_data)
    report = export_pair(config.model_copy(update={"fidelity_dialogues": 2}))
    assert report["models"]["assistant"]["mtp"] and report["chosen"]["mtp"] and not report["chosen"]["eagle3"]
    assert "--spec-type draft-mtp" in (gguf / "llama-server.sh").read_text()
    target = gguf / report["chosen"]["target"]
    messages = read_prompts(demo_data)[-1].messages
    expected = engine_answer((target, None), messages, 24)
    ours = ServeConfig(run=tmp_path / "run", mode="speculative", n_ctx=512, threads=1)
    with running(ours) as url:
        reply = OpenAI(base_url=f"{url}/v1", api_key="unused").chat.completions.create(
            model="spectune", messages=messages, max_tokens=24, temperature=0
        )
        metrics = httpx.get(f"{url}/metrics").text
    assert reply.choices[0].message.content == expected
    assert re.search(r"^spectune_acceptance_rate (\S+)$", metrics, re.M)  # it drafted
    served = ServeConfig(
        run=tmp_path / "run", engine="llama.cpp", llama_server=build_llama_cpp() / SERVER, port=free_port(),
        n_ctx=512, threads=1,
    )  # fmt: skip
    with open(tmp_path / "server.log", "w+") as log, start_llama_server(served, log) as server:
        reply = OpenAI(base_url=f"{server.url}/v1", api_key="unused").chat.completions.create(
            model="spectune", messages=messages, max_tokens=24, temperature=0
        )
        metrics = httpx.get(f"{server.url}/metrics").text
    assert reply.choices[0].message.content == expected
    drafted = re.search(r"^llamacpp:spec_decode_num_draft_tokens_total (\S+)$", metrics, re.M)
    assert drafted is not None and float(drafted.group(1)) > 0  # the assistant drafted
    report = hand_off(HandoffConfig(run=tmp_path / "run", engine="vllm"))  # vLLM 0.33.0 drafts with it (method mtp)
    assert report["mtp"] and '"method": "mtp"' in report["command"]
    assert (tmp_path / "run" / "handoff" / "vllm" / "draft" / "config.json").is_file()
    with pytest.raises(SpectuneError, match=r"MTP assistant.*hand it to vllm"):
        hand_off(HandoffConfig(run=tmp_path / "run", engine="sglang"))


def test_a_checkpoint_with_a_tensor_the_converter_cannot_map_is_refused_naming_it(gemma4_pair, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(gemma4_pair / "target", tmp_path / "extra")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mystery_gate.weight"] = torch.zeros(4, 4)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpectuneError, match=r"cannot map the tensor 'model\.layers\.0\.mystery_gate\.weight'"):
        export_model(folder, tmp_path / "extra.gguf", "F16")
    assert not (tmp_path / "extra.gguf").exists()
