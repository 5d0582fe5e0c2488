"""The prompt prefixes the server shares, and with whom: a tenant's system prompt among its callers, a caller's
conversation for its next turn, a partial turn prefilled while the caller still speaks; never across tenants."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import running

from spectune.runtime.chat import chat_tokens, prompt_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.kv_state import DecoderState, ModelState, load_decoder, save_decoder
from spectune.runtime.llama import LlamaModel
from spectune.runtime.mode import DecoderSource
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.serve.config import ServeConfig
from spectune.serve.prefix_cache import Caller, PrefixStore, Scope, best_reuse, conversation_key, shared_key

KEYS = "sk-tenant-one,sk-tenant-two"
SYSTEM = {"role": "system", "content": "You are the booking line of a restaurant. Be brief and polite, and confirm."}


def state(tokens: list[int], size: int = 100) -> DecoderState:
    empty = np.zeros((0, 0), dtype=np.float32)
    return DecoderState((ModelState(tuple(tokens), bytes(size), empty, empty),))


def test_the_store_forgets_the_least_recently_used_past_its_bytes():
    store = PrefixStore(max_bytes=3 * state([1]).nbytes)
    keys = [(Scope("t"), f"user:{n}") for n in range(4)]
    for key in keys[:3]:
        store.put(key, state([1]))
    assert store.get(keys[0]) is not None  # now the most recently used
    store.put(keys[3], state([1]))
    assert [key in store.entries for key in keys] == [True, False, True, True]
    assert store.bytes == 3 * state([1]).nbytes
    store.put(keys[0], state([1], size=10**6))  # larger than the whole store: not kept, nothing else dropped
    assert store.bytes == 3 * state([1]).nbytes


def test_reuse_follows_the_scope_and_the_caller():
    store, shared_prompt = PrefixStore(1 << 20), [1, 2, 3, 4]
    alice = Caller(Scope("tenant-a"), "alice")
    prompt = [*shared_prompt, 5, 6, 7, 8]
    store.put(shared_key(alice.scope, shared_prompt), state(shared_prompt))
    store.put(conversation_key(alice), state([*shared_prompt, 5, 6, 9]))
    # alice: her conversation as far as it still holds; bob of her tenant: the system prompt, whole
    assert best_reuse(store, alice, None, [], prompt, 4).length == 6
    bob = Caller(Scope("tenant-a"), "bob")
    assert best_reuse(store, bob, None, [], prompt, 4).length == 4
    # another tenant, another cache_salt, or a different system prompt: nothing
    for stranger in (Caller(Scope("tenant-b"), "alice"), Caller(Scope("tenant-a", "salt"), "alice")):
        assert best_reuse(store, stranger, None, [], prompt, 4).length == 0
    assert best_reuse(store, bob, None, [], [1, 2, 3, 7, 5, 6], 4).length == 0
    # the slot's own cache: for the caller it holds, never for the next one
    live = [*prompt, 10]
    assert best_reuse(PrefixStore(0), alice, alice, live, prompt, 4).length == 7
    assert best_reuse(PrefixStore(0), bob, alice, live, prompt, 4).length == 0
    anonymous = Caller(Scope("tenant-a"), None)
    assert best_reuse(PrefixStore(0), anonymous, anonymous, live, prompt, 4).length == 0


def test_the_shared_prefix_ends_where_the_system_messages_do(pair):
    model = LlamaModel(pair[0], n_ctx=512, threads=1)
    user = {"role": "user", "content": "A table for two tonight?"}
    tokens, shared = prompt_tokens(model, [SYSTEM, user])
    alone, _ = prompt_tokens(model, [SYSTEM, {"role": "user", "content": "Cancel my booking."}])
    assert tokens == chat_tokens(model, [SYSTEM, user])
    assert 0 < shared < len(tokens) and tokens[:shared] == alone[:shared]
    lead = model.detokenize(tokens[:shared])
    assert SYSTEM["content"] in lead and "two" not in lead and "two" in model.detokenize(tokens[shared:])
    only, no_system = prompt_tokens(model, [user])
    assert "two" not in model.detokenize(only[:no_system]) and no_system < len(only)


def test_a_restored_prefix_decodes_as_the_prefill_did(pair):
    """Saved from one decoder and loaded into another (another slot): the same answer, and the prefix reused by
    the target and the draft alike."""
    target, draft = pair
    settings = DecodeSettings(max_tokens=12, draft_max=3)

    def decoder() -> SpeculativeDecoder:
        return DecoderSource(target, draft, 512, 1, True, (), {}).load("speculative")

    first, second = decoder(), decoder()
    prompt = chat_tokens(first.target, [SYSTEM, {"role": "user", "content": "A table for two tonight?"}])
    answer = first.generate(prompt, settings, first_words="draft")
    saved = save_decoder(first)
    load_decoder(second, saved)
    again = second.generate(prompt, settings, first_words="draft")
    assert again.text == answer.text
    assert again.stats.reused_prompt_tokens == len(prompt) - 1
    assert again.stats.draft_reused_prompt_tokens > 0


@pytest.fixture(scope="module")
def tenants(pair):
    target, draft = pair
    config = ServeConfig(
        target=target, draft=draft, mode="speculative", n_ctx=1024, threads=1, draft_max=3, api_key=KEYS
    )
    with running(config) as url:
        yield url


def ask(url: str, key: str, body: dict) -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_callers_of_one_tenant_share_its_system_prompt_and_no_one_else(tenants):
    one, two = KEYS.split(",")
    turn = [SYSTEM, {"role": "user", "content": "Do you have a table for four at eight?"}]
    cold = ask(tenants, two, {"messages": turn, "max_tokens": 8, "user": "first", "cache_salt": "cold"})
    assert cached(cold) == 0
    ask(tenants, one, {"messages": turn, "max_tokens": 8, "user": "ann"})
    bob = ask(tenants, one, {"messages": turn, "max_tokens": 8, "user": "bob"})
    assert 0 < cached(bob) < bob["usage"]["prompt_tokens"] - 4  # the system prompt, not ann's question
    # the other tenant, after the first one filled the cache with the same prompt: nothing reused, the same answer
    stranger = ask(tenants, two, {"messages": turn, "max_tokens": 8, "user": "bob"})
    assert cached(stranger) == 0
    assert stranger["choices"][0]["message"] == cold["choices"][0]["message"] == bob["choices"][0]["message"]
    salted = ask(tenants, one, {"messages": turn, "max_tokens": 8, "user": "bob", "cache_salt": "clinic-7"})
    assert cached(salted) == 0


def test_a_callers_next_turn_prefills_only_its_new_words(tenants, pair):
    """While the caller listens, the server decodes the template's text that opens the caller's next turn: that
    turn's prompt is cached up to the caller's new words."""
    one = KEYS.split(",")[0]
    turn = [SYSTEM, {"role": "user", "content": "Is there a table for two at nine?"}]
    answer = ask(tenants, one, {"messages": turn, "max_tokens": 8, "user": "dora"})["choices"][0]["message"]
    deadline = time.time() + 30  # the slot is free once the opening is decoded and the conversation kept
    while httpx.get(f"{tenants}/health").json()["slots_free"] != 1 and time.time() < deadline:
        time.sleep(0.01)
    words = "Then make it ten, please."
    following = [*turn, answer, {"role": "user", "content": words}]
    reply = ask(tenants, one, {"messages": following, "max_tokens": 8, "user": "dora"})
    model = LlamaModel(pair[0], n_ctx=512, threads=1)
    tokens, _ = prompt_tokens(model, following)
    assert reply["usage"]["prompt_tokens"] == len(tokens)
    assert model.detokenize(tokens[cached(reply) :]).lstrip().startswith(words)


def test_words_sent_while_the_caller_speaks_are_prefilled_before_the_turn_ends(tenants):
    one = KEYS.split(",")[0]
    words = "I would like to book a table for two people tomorrow at seven in the evening please"
    partial = words.rsplit(" ", 4)[0] + " at sevn"  # the recognizer's guess, corrected in the final transcript
    said = {"role": "user", "content": partial}
    early = ask(tenants, one, {"messages": [SYSTEM, said], "max_tokens": 0, "user": "carol"})
    assert early["usage"]["completion_tokens"] == 0 and early["choices"][0]["message"]["content"] == ""
    final = [SYSTEM, {"role": "user", "content": words}]
    reply = ask(tenants, one, {"messages": final, "max_tokens": 8, "user": "carol"})
    prompt_length = reply["usage"]["prompt_tokens"]
    assert cached(reply) >= early["usage"]["prompt_tokens"] - 12 and prompt_length - cached(reply) < 16
    stages = reply["spectune"]["stages"]
    assert {"tokenize_seconds", "queue_seconds", "restore_seconds", "prefill_seconds", "first_step_seconds"} <= set(
        stages
    )
    anonymous = httpx.post(
        f"{tenants}/v1/chat/completions",
        json={"messages": final, "max_tokens": 0},
        headers={"Authorization": f"Bearer {one}"},
        timeout=60,
    )
    assert anonymous.status_code == 422 and "user" in anonymous.json()["error"]["message"]
    metrics = httpx.get(f"{tenants}/metrics", headers={"Authorization": f"Bearer {one}"}).text
    assert "spectune_prefix_cache_bytes" in metrics and 'spectune_stage_seconds_count{stage="prefill"}' in metrics


def test_a_spoken_call_reports_each_turns_time_to_first_audio(tenants, tmp_path):
    """`spectune call --speak` from a pipe: each answer synthesized clause by clause, its first audio sample timed
    from the end of the caller's turn, and the median at the end. The synthesizer here is a stand-in on PATH that
    writes a WAV header and samples as espeak-ng --stdout does (espeak-ng itself is not installed on CI)."""
    synthesizer = tmp_path / "espeak-ng"
    synthesizer.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.buffer.write(bytes(44) + b'\\x01' * 800)\n")
    synthesizer.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    spectune = Path(sys.executable).parent / "spectune"
    command = [str(spectune), "call", "--server", tenants, "--speak", "--api-key", KEYS.split(",")[0]]
    turns = "Do you have a table for two tonight?\nThank you, book it.\n"
    done = subprocess.run(command, input=turns, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ms after your turn") == 2, done.stdout
    assert re.search(r"time to first audio: median \d+ ms over 2 turns", done.stdout), done.stdout


def test_a_call_at_a_terminal_sends_the_words_as_they_are_typed(tenants):
    """`spectune call` at a terminal (a pseudo-terminal here): each word typed is sent as a partial transcript
    (max_tokens 0), so the turn's final request finds nearly all of its prompt cached."""
    key = KEYS.split(",")[0]
    spectune = Path(sys.executable).parent / "spectune"
    leader, follower = pty.openpty()
    command = [str(spectune), "call", "--server", tenants, "--api-key", key]
    call = subprocess.Popen(command, stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(follower)
    try:
        assert call.stdout is not None and call.stdout.read(5) == "you> "  # the call is up, reading its terminal
        for word in "Could I book a table for four people at eight tonight please".split():
            os.write(leader, f"{word} ".encode())
            time.sleep(0.4)  # a partial transcript at most every 0.3 s
        os.write(leader, b"\r")
        time.sleep(0.2)
        os.write(leader, b"\x04")  # Ctrl-D: the call ends
        out, err = call.communicate(timeout=300)
    finally:
        os.close(leader)
        if call.poll() is None:
            call.kill()
    assert call.returncode == 0, err
    cached, total = map(int, re.search(r"(\d+)/(\d+) prompt tokens cached", out).groups())
    assert total - cached <= 8, out  # the words were prefilled while typed: only the template's close is new
