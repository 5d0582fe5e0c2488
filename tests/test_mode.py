"""The way serve and generate decode: speculative at the exact settings, or the target alone at llama.cpp's fastest
(runtime/mode.py), chosen by measuring both (auto) or forced."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import run_cli, running

from spectune.errors import SpectuneError
from spectune.runtime import mode as mode_module
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.mode import (
    CALIBRATION_PROMPTS,
    DecoderSource,
    ModeChoice,
    calibrate,
    choose,
    faster,
    settle_auto,
)
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
    # --mode speculative with nothing to speculate with: the target alone at the exact settings, the "target alone"
    # that speculative answers equal (before: the fastest settings, another target alone)
    forced, decoder = choose("speculative", source_of(pair, draft=False), [], DecodeSettings())
    assert forced.mode == "speculative" and "exact settings" in forced.reason
    assert decoder.target.exact is True and not decoder.speculators


def test_auto_serves_what_it_recorded_whatever_a_later_timing_says(pair, monkeypatch, tmp_path):
    """The same request to the same server gets the same answer after a restart: auto's choice is measured once per
    pair, build, machine and settings, and served again, until --recalibrate."""
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path))
    timings = iter([("speculative", 12.0, 10.0), ("fastest", 9.0, 11.0)])

    def measured(*_):
        mode, speculative, fastest = next(timings)
        return ModeChoice(mode, "measured here (a stand-in timing)", speculative, fastest)

    monkeypatch.setattr(mode_module, "calibrate", measured)
    first, _ = choose("auto", source_of(pair), [], DecodeSettings())
    again, decoder = choose("auto", source_of(pair), [], DecodeSettings())
    assert first.mode == again.mode == "speculative" and "recorded" in again.reason
    assert decoder.target.exact is True and decoder.speculators
    other_settings, _ = choose("auto", source_of(pair), [], DecodeSettings(max_tokens=7))
    assert other_settings.mode == "fastest"  # another key: measured anew (the stand-in's second timing)
    monkeypatch.setattr(mode_module, "calibrate", lambda *_: ModeChoice("fastest", "measured here", 1.0, 2.0))
    measured_again, _ = choose("auto", source_of(pair), [], DecodeSettings(), recalibrate=True)
    assert measured_again.mode == "fastest"
    assert choose("auto", source_of(pair), [], DecodeSettings())[0].mode == "fastest"  # the new record


def test_fastest_refuses_the_speculation_settings_it_would_drop(pair):
    with pytest.raises(ValueError, match="draft_max, ngram: speculation settings, unused by --mode fastest"):
        ServeConfig(target=pair[0], mode="fastest", draft_max=4, ngram={})
    assert ServeConfig(target=pair[0], mode="fastest").mode == "fastest"


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


def test_serve_measures_auto_in_a_process_of_its_own_and_then_serves_the_record(pair, monkeypatch, tmp_path):
    """`spectune serve --mode auto` has decoded nothing when it loads the chosen mode (so the fastest one prefills
    with the tiled matmul): the child measured and recorded, the server reads the record."""
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path))
    conversations = calibration_conversations(None)[:1]
    settled = settle_auto(source_of(pair), conversations, DecodeSettings(), recalibrate=False)
    assert settled.speculative_tokens_per_second > 0 and settled.fastest_tokens_per_second > 0
    assert len(list((tmp_path / "modes").glob("*.json"))) == 1  # recorded by the child
    monkeypatch.setattr(mode_module, "calibrate", lambda *_: pytest.fail("measured again in the server"))
    served, _ = choose("auto", source_of(pair), conversations, DecodeSettings())
    assert served.mode == settled.mode and "recorded" in served.reason
    assert settle_auto(source_of(pair), conversations, DecodeSettings(), recalibrate=False).mode == settled.mode


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
    assert "exact off; answers=target-alone-fastest" in reply["system_fingerprint"]
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


def test_calibration_takes_prompts_without_answers_and_names_a_binary_file(tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"messages": [{"role": "user", "content": "Is the shop open on Sunday?"}]}) + "\n")
    assert calibration_conversations(questions) == [[{"role": "user", "content": "Is the shop open on Sunday?"}]]
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SpectuneError, match=r"model\.bin: not UTF-8"):
        calibration_conversations(binary)


def test_calibration_data_that_cannot_be_read_says_so(tmp_path):
    with pytest.raises(SpectuneError, match="no such file"):
        calibration_conversations(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SpectuneError, match=r"empty\.jsonl"):
        calibration_conversations(empty)
