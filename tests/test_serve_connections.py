"""The server's connections against the fourth probe: the connection cap fits the open-file limit, a caller who showed
the key keeps its upload while strangers are made room for, and a request cut at the connection (too slow, made room
for, shut down) gets a JSON answer before the close, counted as what it was. Each test failed before its fix."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import running
from test_serve_hardening import ask, serving_process
from test_serve_limits import connect, metric

from spectune.errors import SpectuneError
from spectune.serve.config import ServeConfig
from spectune.serve.connections import DESCRIPTOR_RESERVE, fit_connections

KEY = "sk-connections"
AUTH = {"Authorization": f"Bearer {KEY}"}


def upload_head(body_length: int, key: str | None = KEY) -> bytes:
    """A chat request's complete headers (with the key where given), its body still to come."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {body_length}\r\n\r\n"
    ).encode()


def answer_of(connection: socket.socket) -> tuple[int, dict]:
    """The status and JSON body the server sent on a raw connection before closing it."""
    connection.settimeout(30)
    raw = b""
    while chunk := connection.recv(65536):
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_the_cap_fits_the_open_file_limit_or_is_refused_naming_both():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap, limit = fit_connections(10**6, explicit=False)  # the default past the limit: lowered to fit
    in_use = len(os.listdir("/proc/self/fd"))
    assert limit >= soft and cap <= limit - DESCRIPTOR_RESERVE - in_use + 2  # (+2: this listing's own descriptors)
    assert fit_connections(16, explicit=True) == (16, limit)
    with pytest.raises(SpectuneError, match=rf"--max-connections {10**6}: the open-file limit is {limit}"):
        fit_connections(10**6, explicit=True)


def file_limit(limit: int) -> Callable[[], None]:
    """What a child process runs before it starts: its open-file limit, soft and hard, set to `limit`."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def test_1100_idle_sockets_under_a_1024_file_limit_lock_no_one_out(pair, messages):
    """Before: the cap (1,024) was above what the descriptors allowed, accepting failed before any eviction ran, and
    every caller, /health included, was reset."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1300:  # this test's own 1,100 sockets need room in the test process
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    flags = ("--mode", "speculative", "--api-key", KEY, "--header-timeout", "60")
    with serving_process(pair, *flags, stderr=subprocess.DEVNULL, preexec_fn=file_limit(1024)) as (_, url):
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["open_file_limit"] == 1024 and health["max_connections"] < 1024 - DESCRIPTOR_RESERVE
        idle = []
        try:
            for _ in range(1100):
                idle.append(connect(url))
            time.sleep(1)
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            reply = ask(url, {"messages": messages, "max_tokens": 4}, headers=AUTH)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
            evicted = metric(url, 'spectune_connections_closed_total{reason="evicted"}', KEY)
            assert evicted >= 1100 - health["max_connections"]  # the idle ones past the cap, at least
        finally:
            for connection in idle:
                connection.close()


def test_strangers_never_evict_an_upload_that_showed_the_key(pair, messages):
    config = ServeConfig(
        target=pair[0], n_ctx=256, threads=1, max_connections=8, header_timeout=30, body_timeout=30, api_key=KEY
    )
    body = json.dumps({"messages": messages, "max_tokens": 2}).encode()
    with running(config) as url:
        upload = connect(url)
        upload.sendall(upload_head(len(body)) + body[:10])
        time.sleep(0.2)
        strangers = [connect(url) for _ in range(20)]
        try:
            time.sleep(0.5)
            upload.sendall(body[10:])
            status, answer = answer_of_response(upload)
            assert status == 200 and answer["choices"][0]["message"]["content"] is not None
            assert metric(url, 'spectune_connections_closed_total{reason="evicted"}', KEY) >= 13
            assert metric(url, 'spectune_requests_total{status="499"}', KEY) == 0
        finally:
            upload.close()
            for connection in strangers:
                connection.close()


def answer_of_response(connection: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of one whole response on a kept-alive connection (read by its Content-Length)."""
    connection.settimeout(60)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += connection.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-len"))
    while len(body) < length:
        body += connection.recv(65536)
    return int(head.split()[1]), json.loads(body)


def test_an_upload_made_room_for_is_answered_503_and_counted_so(pair):
    """Without a key every connection is a stranger: an upload may make room, after every idle one, and then its
    caller hears why (before: no response, counted as the caller hanging up, 499)."""
    config = ServeConfig(target=pair[0], n_ctx=256, threads=1, max_connections=4, header_timeout=30, body_timeout=30)
    with running(config) as url:
        upload = connect(url)
        upload.sendall(upload_head(1000, key=None) + b'{"messages"')
        others = []
        for _ in range(4):  # uploads too: idle connections would make room first
            time.sleep(0.2)
            others.append(connect(url))
            others[-1].sendall(upload_head(1000, key=None) + b'{"messages"')
        try:
            status, answer = answer_of(upload)
            assert status == 503 and answer["error"]["type"] == "server_busy"
        finally:
            upload.close()
            for connection in others:  # real hang-ups mid-upload (and room for the metrics' own connection)
                connection.close()
        time.sleep(0.5)
        assert metric(url, 'spectune_requests_total{status="503"}') == 1
        assert metric(url, 'spectune_requests_total{status="499"}') == len(others)


def test_a_body_too_slow_gets_a_json_408_before_the_close(pair):
    config = ServeConfig(target=pair[0], n_ctx=256, threads=1, body_timeout=1, header_timeout=30, api_key=KEY)
    with running(config) as url:
        upload = connect(url)
        upload.sendall(upload_head(1000) + b'{"messages"')
        status, answer = answer_of(upload)
        upload.close()
        assert status == 408 and answer["error"]["type"] == "request_timeout"
        assert "did not arrive within 1 s" in answer["error"]["message"]
        assert metric(url, 'spectune_requests_total{status="408"}', KEY) == 1


def test_shutdown_answers_an_upload_in_progress_at_once(pair):
    """Before: the stop waited for the upload's body timeout (here a minute), and the caller heard nothing."""
    config = ServeConfig(target=pair[0], n_ctx=256, threads=1, body_timeout=60, header_timeout=60)
    upload = None
    with running(config) as url:
        upload = connect(url)
        upload.sendall(upload_head(1000, key=None) + b'{"messages"')
        time.sleep(0.2)
    # the block's end stopped the server and joined its thread (30 s at most): the upload was answered on the way
    status, answer = answer_of(upload)
    upload.close()
    assert status == 503 and answer["error"]["type"] == "server_shutting_down"
