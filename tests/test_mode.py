"""The way serve and generate decode: speculative at the exact settings, or the target alone at llama.cpp's fastest
(runtime/mode.py), chosen by measuring both (auto) or forced."""

from __future__ import annotations

import httpx
import pytest
from conftest import run_cli, running

from spectune.errors import SpectuneError
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.mode import CALIBRATION_PROMPTS, DecoderSource, calibrate, choose, faster
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.serve.config import ServeConfig
from spectune.serve.slots import calibration_conversations


def source_of(pair, draft: bool = True) -> DecoderSource:
    target, draft_path = pair
    return DecoderSource(target, draft_path if draft else None, 512, 1, True)


def test_the_rule_speculates_only_where_it_is_faster():
    assert faster(12.0, 10.0) == "speculative"
    assert faster(10.0, 12.0) == "fastest"
    assert faster(10.0, 10.0) == "fastest"  # a tie: nothing to gain from the exact settings' cost


def test_without_a_draft_the_target_alone_runs_at_llama_cpps_fastest_settings(pair):
    choice, decoder = choose("auto", source_of(pair, draft=False), [], DecodeSettings())
    assert choice.mode == "fastest" and choice.speculative_tokens_per_second is None
    assert not decoder.speculators and decoder.target.exact is False
    forced, decoder = choose("speculative", source_of(pair, draft=False), [], DecodeSettings())
    assert forced.mode == "fastest"  # nothing to speculate with: the flag cannot ask for a draft that is not there
    assert decoder.target.exact is False


def test_forced_modes_load_what_they_say(pair):
    choice, decoder = choose("speculative", source_of(pair), [], DecodeSettings())
    assert choice.mode == "speculative" and choice.reason == "--mode speculative"
    assert decoder.target.exact is True and len(decoder.speculators.models) == 1
    choice, decoder = choose("fastest", source_of(pair), [], DecodeSettings())
    assert choice.mode == "fastest" and decoder.target.exact is False and not decoder.speculators


def test_auto_measures_both_and_keeps_the_faster(pair, demo_data):
    conversations = calibration_conversations(demo_data, count=2)
    assert len(conversations) == 2 and conversations[0][-1]["role"] == "user"
    choice, decoder = choose("auto", source_of(pair), conversations, DecodeSettings())
    assert choice.speculative_tokens_per_second > 0 and choice.fastest_tokens_per_second > 0
    assert choice.mode == faster(choice.speculative_tokens_per_second, choice.fastest_tokens_per_second)
    assert bool(decoder.speculators) == (choice.mode == "speculative")
    assert decoder.target.exact == (choice.mode == "speculative")
    assert "measured here on 2 prompts" in choice.reason


def test_calibration_leaves_both_caches_empty(pair):
    source = source_of(pair)
    speculative, fastest = source.load("speculative"), source.load("fastest")
    choice = calibrate(speculative, fastest, calibration_conversations(None), DecodeSettings())
    assert f"on {len(CALIBRATION_PROMPTS)} prompts" in choice.reason
    assert speculative.target.cached == [] and fastest.target.cached == []  # the first caller shares nothing


def test_the_fastest_server_says_so_and_answers_as_the_target_alone_at_those_settings(pair, messages):
    target, _ = pair
    model = LlamaModel(target, n_ctx=512, threads=1, exact=False)
    expected = SpeculativeDecoder(model).generate(model.tokenize(chat_prompt(model, messages)), DecodeSettings())
    with running(ServeConfig(target=target, n_ctx=512, threads=1)) as url:
        health = httpx.get(f"{url}/health").json()
        body = {"messages": messages, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        metrics = httpx.get(f"{url}/metrics").text
    assert health["mode"] == "fastest" and "no draft" in health["mode_reason"]
    assert reply["choices"][0]["message"]["content"] == expected.text
    assert "exact off; the target alone" in reply["system_fingerprint"]
    assert 'spectune_mode{mode="fastest"} 1.0' in metrics and 'spectune_mode{mode="speculative"} 0.0' in metrics


def test_a_speculative_server_reports_what_auto_measured(pair):
    target, draft = pair
    config = ServeConfig(target=target, draft=draft, n_ctx=512, threads=1, draft_max=4)
    with running(config) as url:
        health = httpx.get(f"{url}/health").json()
        metrics = httpx.get(f"{url}/metrics").text
    assert health["mode"] in ("speculative", "fastest") and "measured here" in health["mode_reason"]
    assert 'spectune_mode_calibration_tokens_per_second{mode="speculative"}' in metrics
    assert 'spectune_mode_calibration_tokens_per_second{mode="fastest"}' in metrics


@pytest.mark.parametrize("mode", ["fastest", "speculative"])
def test_generate_takes_the_mode(pair, mode, capsys):
    target, draft = pair
    args = ("generate", "--target", str(target), "--draft", str(draft), "--prompt", "hi", "--max-tokens", "8")
    assert run_cli(*args, "--mode", mode, "--threads", "1") == 0
    assert f"mode {mode} (--mode {mode})" in capsys.readouterr().out


def test_mode_is_spectunes_own_setting(pair):
    with pytest.raises(ValueError, match="mode"):
        ServeConfig(target=pair[0], engine="llama.cpp", mode="fastest")


def test_calibration_data_that_cannot_be_read_says_so(tmp_path):
    with pytest.raises(SpectuneError, match="no such file"):
        calibration_conversations(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SpectuneError, match=r"empty\.jsonl"):
        calibration_conversations(empty)
