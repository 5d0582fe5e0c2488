"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official openai client and httpx."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import run_cli, running

from spectune.llama_cpp_pin import patched_build
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.serve.config import ServeConfig
from spectune.serve.launch import serve_in_thread

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(pair):
    target, draft = pair
    with running(
        ServeConfig(
            target=target, draft=draft, mode="speculative", n_ctx=512, threads=1, queue_timeout=2.0, draft_max=4
        )
    ) as url:
        yield url


def engine_answer(pair, messages, max_tokens: int) -> str:
    target = LlamaModel(pair[0], n_ctx=512, threads=1)
    generation = SpeculativeDecoder(target).generate(
        target.tokenize(chat_prompt(target, messages)), DecodeSettings(max_tokens=max_tokens)
    )
    return generation.text


def test_openai_client_non_stream_and_stream_match_the_engine(server, pair, messages):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    expected = engine_answer(pair, messages, 24)
    reply = client.chat.completions.create(model="spectune", messages=messages, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens > 0
    # Which build and setting made the answer: the install's, exact, so identical to the target alone.
    patched = f"llama-cpp-python {patched_build()}, llamafile off"  # the install's build: the pin with spectune's patch
    assert reply.system_fingerprint == f"{patched}; exact on; answers=target-alone-exact"
    pieces, parts = [], []
    stream = client.chat.completions.create(
        model="spectune", messages=messages, max_tokens=24, stream=True, stream_options={"include_usage": True}
    )
    for part in stream:
        if part.choices and part.choices[0].delta.content:
            pieces.append(part.choices[0].delta.content)
        parts.append(part)
    assert "".join(pieces) == expected
    assert {part.system_fingerprint for part in parts} == {reply.system_fingerprint}
    assert parts[-2].choices[0].finish_reason in ("stop", "length")
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["spectune"]


def test_sentence_chunking_streams_whole_clauses(server, messages):
    body = {"messages": messages, "max_tokens": 40, "stream": True, "chunking": "sentence"}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        chunks = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    texts = [c["choices"][0]["delta"].get("content") for c in chunks]
    texts = [t for t in texts if t]
    assert len(texts) >= 2, texts  # several clauses, or nothing below is checked
    for text in texts[:-1]:  # every chunk but the last ends a clause
        assert text.rstrip()[-1] in ".!?;:,", texts
    assert chunks[-1]["spectune"]["ttft_seconds"] > 0


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b'{"max_tokens": 5}', 400, "messages"),
        (b'{"messages": []}', 422, "messages"),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}', 422, "role"),
        (b'{"messages": [{"role": "user", "content": "  "}]}', 422, "empty content"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 9}', 422, "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": -1}', 422, "seed"),
        (json.dumps({"messages": [{"role": "user", "content": "word " * 800}]}).encode(), 413, "context"),
    ],
)
def test_bad_input_gets_an_openai_style_error_and_the_server_keeps_serving(server, body, status, needle):
    response = httpx.post(
        f"{server}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    assert httpx.get(f"{server}/health").json()["slots_free"] == 1


def test_a_disconnected_client_stops_its_generation_and_frees_the_slot(server, messages, monkeypatch):
    real_generate = SpeculativeDecoder.generate
    outcomes = []

    # 50 ms a step, like a bigger model

    def slow_steps(self, prompt, config, on_text=None, first_words="draft", checkpoint=None):
        def paced(text):
            time.sleep(0.05)
            keep_going = on_text(text)
            outcomes.append(keep_going)
            return keep_going

        return real_generate(self, prompt, config, paced, first_words, checkpoint)

    monkeypatch.setattr(SpeculativeDecoder, "generate", slow_steps)
    body = {"messages": messages, "max_tokens": 400, "stream": True, "temperature": 1.0, "seed": 3}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        next(response.iter_lines())  # the first chunk arrived; now hang up
    deadline = time.time() + 20
    while httpx.get(f"{server}/health").json()["slots_free"] != 1 and time.time() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server}/health").json()["slots_free"] == 1
    assert outcomes and outcomes[-1] is False  # the generation was told to stop, and stopped
    monkeypatch.setattr(SpeculativeDecoder, "generate", real_generate)
    ok = httpx.post(f"{server}/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


def test_metrics_are_exposed(server, messages):
    httpx.post(f"{server}/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=60)
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "spectune_ttft_seconds",
        "spectune_tokens_per_second",
        "spectune_acceptance_rate",
        "spectune_mean_accepted_len",
        "spectune_queue_depth",
        "spectune_requests_total",
    ):
        assert name in text


def test_api_key_is_required_except_for_health(pair, messages):
    target, draft = pair
    instance, thread, url = serve_in_thread(
        ServeConfig(target=target, draft=draft, mode="speculative", n_ctx=256, threads=1, api_key=KEY)
    )
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        denied = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
        allowed = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": messages, "max_tokens": 2},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert allowed.status_code == 200
    finally:
        instance.stop()
        thread.join(timeout=10)


def test_a_request_that_waits_too_long_gets_503_with_retry_after(pair, messages, monkeypatch):
    slow_generate = SpeculativeDecoder.generate

    def slow(self, *args, **kwargs):  # a generation that holds its slot for a while, like a big model on a CPU
        time.sleep(3)
        return slow_generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", slow)
    target, draft = pair
    instance, thread, url = serve_in_thread(
        ServeConfig(target=target, draft=draft, mode="speculative", n_ctx=512, threads=1, slots=1, queue_timeout=0.5)
    )
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={"messages": messages, "max_tokens": 8, "stream": True},
            timeout=60,
        ) as busy:
            next(busy.iter_lines())  # the only slot is taken
            refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=30)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "server_busy"
        too_big = httpx.post(
            f"{url}/v1/chat/completions",
            content=b"x" * (2 << 20),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert too_big.status_code == 413
    finally:
        instance.stop()
        thread.join(timeout=10)


def test_the_servers_decoding_settings_are_what_a_request_leaves_unset(pair, messages):
    """`spectune serve --max-tokens 3 --ignore-eos` caps a request that names no length; one that names its own
    settings gets them (as llama-server's -n and --ignore-eos)."""
    target, draft = pair
    config = ServeConfig(
        target=target, draft=draft, mode="speculative", n_ctx=512, threads=1, max_tokens=3, ignore_eos=True
    )
    with running(config) as url:
        unset = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages}, timeout=60).json()
        named = {"messages": messages, "max_tokens": 5, "ignore_eos": False, "temperature": 0}
        own = httpx.post(f"{url}/v1/chat/completions", json=named, timeout=60).json()
    assert unset["usage"]["completion_tokens"] == 3 and unset["choices"][0]["finish_reason"] == "length"
    assert own["choices"][0]["message"]["content"] == engine_answer(pair, messages, 5)


def test_generate_takes_every_decoding_setting_as_a_flag(pair, capsys):
    target, draft = pair
    flags = ["--max-tokens", "6", "--ignore-eos", "--top-k", "3", "--draft-max", "2", "--draft-p-min", "0.1"]
    assert run_cli("generate", "--target", str(target), "--draft", str(draft), "--prompt", "hi", *flags) == 0
    assert "6 tokens" in capsys.readouterr().out
    assert run_cli("generate", "--target", str(target), "--prompt", "hi", "--temperature", "-1") != 0
