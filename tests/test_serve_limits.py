"""The server against the third probe (issue 59): connections that send nothing or trickle, an answer cut by
shutdown, usage counted for the request it is sent with, clause ends in other scripts, upload hang-ups, and the small
items. Each test failed before its fix."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from conftest import run_cli, running
from pydantic import ValidationError
from test_serve import engine_answer
from test_serve_hardening import ask, pace_generations

from spectune.errors import SpectuneError
from spectune.runtime.chat import CLAUSE_END
from spectune.runtime.llama import LlamaModel
from spectune.runtime.ngram import NgramDrafter, NgramSettings
from spectune.runtime.text import TextStream
from spectune.serve import slots as slots_module
from spectune.serve.app import Server
from spectune.serve.client import _turn
from spectune.serve.config import ServeConfig
from spectune.serve.launch import serve_in_thread
from spectune.serve.schema import ChatRequest

KEY = "sk-limits"


def metric(url: str, name: str, key: str | None = None) -> float:
    """A counter's value on /metrics (0 when it has no sample yet)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{url}/metrics", timeout=10, headers=headers).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


def slow_upload(url: str) -> socket.socket:
    """An authenticated request whose body never comes: complete headers, 10 bytes of a promised 10,000."""
    connection = connect(url)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 10000\r\n\r\n"
    )
    connection.sendall(head.encode() + b'{"message')
    return connection


def test_idle_and_slow_body_connections_lock_no_caller_out(pair, messages):
    """200 connections that send nothing and 200 authenticated uploads that never finish: /health answers at once, a
    caller with the key gets the target alone's answer, and the slow uploads are cut and counted as 408."""
    target, draft = pair
    config = ServeConfig(
        target=target,
        draft=draft,
        n_ctx=512,
        threads=1,
        api_key=KEY,
        header_timeout=30,
        body_timeout=3,
        draft_max=4,
        mode="speculative",
    )
    expected = engine_answer(pair, messages, 12)
    with running(config) as url:
        hostile = [connect(url) for _ in range(200)] + [slow_upload(url) for _ in range(200)]
        try:
            for _ in range(5):  # answered while the hostile connections are open (how fast: a benchmark's question)
                assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            reply = ask(url, {"messages": messages, "max_tokens": 12}, headers={"Authorization": f"Bearer {KEY}"})
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == expected
            time.sleep(4)  # past the body timeout
            assert metric(url, 'spectune_requests_total{status="408"}', KEY) == 200
            assert metric(url, 'spectune_connections_closed_total{reason="body_timeout"}', KEY) == 200
        finally:
            for connection in hostile:
                connection.close()


def test_past_max_connections_the_oldest_idle_one_makes_room(pair, messages):
    config = ServeConfig(target=pair[0], n_ctx=256, threads=1, max_connections=8, header_timeout=30)
    with running(config) as url:
        idle = [connect(url) for _ in range(8)]
        try:
            time.sleep(0.2)
            assert ask(url, {"messages": messages, "max_tokens": 2}).status_code == 200
            idle[0].settimeout(5)
            assert idle[0].recv(1) == b""  # the oldest, closed for the caller
            assert metric(url, 'spectune_connections_closed_total{reason="evicted"}') >= 1
        finally:
            for connection in idle:
                connection.close()


def test_requests_past_the_limit_are_refused_in_json_and_counted(pair, messages, monkeypatch):
    pace_generations(monkeypatch, 0.05)
    config = ServeConfig(target=pair[0], n_ctx=512, threads=1, slots=1, limit_concurrency=1, queue_timeout=30)
    with running(config) as url:
        body = {"messages": messages, "max_tokens": 40, "ignore_eos": True}
        first = threading.Thread(target=ask, args=(url, body))
        first.start()
        time.sleep(0.5)
        refused = ask(url, {"messages": messages, "max_tokens": 2})
        first.join()
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_busy"
        assert metric(url, 'spectune_requests_total{status="503"}') == 1


def test_an_answer_cut_by_shutdown_says_so(pair, messages, monkeypatch):
    pace_generations(monkeypatch, 0.05)
    config = ServeConfig(target=pair[0], n_ctx=1024, threads=1, slots=2, queue_timeout=30)
    instance, thread, url = serve_in_thread(config)
    long = {"messages": messages, "max_tokens": 800, "ignore_eos": True}
    whole: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: whole.append(ask(url, long)))
    waiting.start()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**long, "stream": True}, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        time.sleep(0.5)
        counted = httpx.get(f"{url}/metrics", timeout=10).text
        instance.stop()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    waiting.join(timeout=30)
    thread.join(timeout=30)
    final = next(e for e in events if "spectune" in e)
    assert final["choices"][0]["finish_reason"] == "abort"
    assert events[-1]["error"]["code"] == 503 and "cut after" in events[-1]["error"]["message"]
    assert whole[0].status_code == 503 and "cut after" in whole[0].json()["error"]["message"]
    assert 'status="200"' not in counted


def test_continuous_usage_counts_only_its_own_request(pair, messages, monkeypatch):
    """A slow reader's chunks carry its own request's counts while the slot already serves the next caller."""
    config = ServeConfig(target=pair[0], n_ctx=2048, threads=1, slots=1, queue_timeout=60)
    with running(config) as url:
        body = {
            "messages": messages,
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        }
        other = [*messages, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And more? " * 60}]
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            next(lines)
            time.sleep(8)  # the 1,500 tokens are made; most chunks wait unread
            pace_generations(monkeypatch, 0.2)
            threading.Thread(target=ask, args=(url, {"messages": other, "max_tokens": 50}), daemon=True).start()
            time.sleep(2)  # the other caller now holds the slot
            counts = [json.loads(line[6:])["usage"] for line in lines if line.startswith('data: {"id"')]
        prompts = {c["prompt_tokens"] for c in counts}
        generated = [c["completion_tokens"] for c in counts]
        assert len(prompts) == 1 and generated == sorted(generated) and generated[-1] == 1500


def test_clauses_end_in_the_scripts_people_speak():
    for text, clause in (
        ("好的，我来帮您预订。", "好的，"),
        ("请问几位？两位。", "请问几位？"),
        ("حسنا، سأحجز لك.", "حسنا،"),
        ("هل تريد الحجز؟ نعم", "هل تريد الحجز؟"),
        ("Sure, I can.", "Sure, "),
    ):
        assert text[: CLAUSE_END.search(text).end()] == clause
    assert CLAUSE_END.search("3.5 stars") is None  # a decimal point ends nothing


def test_an_abbreviation_ends_no_clause():
    text = "Dr. Lee, e.g. at No. 5 St. Mark's Road. Then"
    assert [text[: match.end()] for match in CLAUSE_END.finditer(text)] == [
        "Dr. Lee, ",
        "Dr. Lee, e.g. at No. 5 St. Mark's Road. ",
    ]
    assert CLAUSE_END.search("Casino. Open") is not None  # a word that ends like one is still a sentence's end


def test_tool_calls_and_parts_that_are_not_text_are_refused_by_name():
    assistant = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
    with pytest.raises(ValidationError) as refused:
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}, assistant]})
    error = refused.value.errors()[0]
    assert error["loc"] == ("messages", 1, "tool_calls") and "tool calls are not supported" in error["msg"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ValidationError) as refused:
        ChatRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]})
    error = refused.value.errors()[0]
    assert error["loc"] == ("messages", 0, "content") and "part 1 is of type 'image_url'" in error["msg"]
    plain = {"role": "assistant", "content": "ok", "tool_calls": []}  # none made: nothing dropped
    assert ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}, plain]})


def test_lookup_trust_is_learned_per_caller():
    drafter = NgramDrafter(NgramSettings(domain=False, min_n=2, max_n=2))
    sequence = [1, 2, 3, 1, 2, 3, 1, 2]
    proposal = drafter.propose(sequence, 2, lambda token: False)
    drafter.verified(proposal, 0)
    assert drafter.kept or drafter.expected
    drafter.forget()
    assert not drafter.kept and not drafter.expected and drafter.indexed == []


def test_a_caller_who_hangs_up_during_the_upload_counts_as_499(pair, messages, caplog):
    with running(ServeConfig(target=pair[0], n_ctx=256, threads=1)) as url:
        for _ in range(3):
            connection = connect(url)
            connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{")
            time.sleep(0.2)
            connection.close()
        time.sleep(0.5)
        assert metric(url, 'spectune_requests_total{status="499"}') == 3
        assert metric(url, 'spectune_requests_total{status="500"}') == 0
    assert "Traceback" not in caplog.text


def test_a_queued_caller_who_hangs_up_counts_as_499(pair, messages, monkeypatch):
    pace_generations(monkeypatch, 0.05)
    config = ServeConfig(target=pair[0], n_ctx=512, threads=1, slots=1, queue_timeout=1.0)
    with running(config) as url:
        busy = threading.Thread(target=ask, args=(url, {"messages": messages, "max_tokens": 60, "ignore_eos": True}))
        busy.start()
        time.sleep(0.3)
        with pytest.raises(httpx.ReadTimeout):  # it gives up before the server's queue timeout, and goes away
            httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=0.5)
        busy.join()
        time.sleep(1)
        assert metric(url, 'spectune_requests_total{status="499"}') == 1
        assert metric(url, 'spectune_requests_total{status="503"}') == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "JUNK"], "not a readable GGUF file"),
        (["--target", "TARGET", "--draft", "JUNK"], "not a readable GGUF file"),
        (["--target", "TARGET", "--ngram", "min_n=5", "--ngram", "max_n=3"], "min_n 5 is above max_n 3"),
        (["--target", "TARGET", "--ngram-data", "JUNK"], "give --ngram too"),
    ],
)
def test_serve_refuses_bad_input_in_one_line(pair, tmp_path, capsys, args, message):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(64)))
    argv = [str(junk) if a == "JUNK" else str(pair[0]) if a == "TARGET" else a for a in args]
    assert run_cli("serve", *argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_control_tokens_are_not_an_answers_text(pair):
    # An ignore_eos answer runs past the end of its turn into the template's next one: its control tokens are not
    # text (vLLM's skip_special_tokens), what follows them is
    model = LlamaModel(pair[0], n_ctx=256, threads=1)
    tokens = model.tokenize("Done.<|im_end|>\n<|im_start|>user\nHi")
    assert model.detokenize(tokens).count("<|im_start|>") == 1  # the template's own rendering keeps them
    stream = TextStream(model, [])
    assert stream.add(tokens) + stream.finish() == "Done.\nuser\nHi"


def test_min_tokens_holds_stop_strings(pair, messages):
    with running(ServeConfig(target=pair[0], n_ctx=1024, threads=1)) as url:
        free = ask(url, {"messages": messages, "max_tokens": 30, "ignore_eos": True}).json()
        text = free["choices"][0]["message"]["content"]
        stop = text.split()[1]  # a word the answer says early
        early = ask(url, {"messages": messages, "max_tokens": 30, "stop": [stop]}).json()
        held = ask(url, {"messages": messages, "max_tokens": 30, "stop": [stop], "min_tokens": 20}).json()
        assert early["usage"]["completion_tokens"] < 20 <= held["usage"]["completion_tokens"]


def test_call_gives_up_on_a_server_that_hangs(monkeypatch, capsys):
    import io

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello?\n"))
    began = time.monotonic()
    try:
        assert run_cli("call", "--server", url, "--timeout", "1") == 2
    finally:
        listener.close()
    assert time.monotonic() - began < 10
    assert "no answer within 1 s" in capsys.readouterr().err


def test_a_double_ctrl_c_under_load_answers_in_json_and_logs_no_traceback(pair):
    """The second SIGINT is uvicorn's forced quit, which cancels the requests in flight: uvicorn answered them with
    a plain-text 500 and logged a traceback for each."""
    from test_serve_hardening import LONG, serving_process

    with serving_process(pair) as (server, url):
        replies: list[httpx.Response] = []

        def call() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server may go away under it
                replies.append(ask(url, {**LONG, "max_tokens": 1600, "ignore_eos": True}))

        callers = [threading.Thread(target=call) for _ in range(3)]
        for caller in callers:
            caller.start()
        time.sleep(0.5)
        server.send_signal(signal.SIGINT)
        time.sleep(0.05)
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)
        for caller in callers:
            caller.join(timeout=60)
        log = server.stderr.read().decode()
    assert code in (0, -signal.SIGINT), log[-2000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    for reply in replies:
        assert reply.headers["content-type"].startswith("application/json")
        assert reply.status_code == 503, reply.text


def test_call_says_an_answer_the_server_cut_is_not_whole(capsys):
    events = [
        {"choices": [{"delta": {"content": "Your table is "}, "finish_reason": None}]},
        {"choices": [{"delta": {}, "finish_reason": "abort"}], "spectune": {}},
        {"error": {"message": "the server shut down while answering: the answer was cut after 4 tokens"}},
    ]
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
    with httpx.Client(transport=transport, base_url="http://server") as client:
        answer, _ = _turn(client, {"messages": []}, None)
    out = capsys.readouterr().out
    assert answer == "Your table is " and "not whole" in out and "the answer was cut: " in out


def test_slots_past_the_memory_left_are_refused_before_they_load(pair, monkeypatch):
    """Before: 500 slots loaded one by one until memory ran out."""
    monkeypatch.setattr(slots_module, "available_memory", lambda: 200 << 20)
    with pytest.raises(
        SpectuneError, match=r"--slots 8: each slot past the first needs about \d+ MiB in --mode fastest"
    ):
        Server(ServeConfig(target=pair[0], n_ctx=1024, threads=1, slots=8))
    monkeypatch.setattr(slots_module, "available_memory", lambda: 64 << 30)
    assert Server(ServeConfig(target=pair[0], n_ctx=256, threads=1, slots=2)).slots.qsize() == 2
    with pytest.raises(ValidationError, match="slots"):
        ServeConfig(target=pair[0], slots=500)
