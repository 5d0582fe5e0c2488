"""The prompt prefixes a server keeps, and who may use them.

A voice bot's calls share a long operator-written system prompt and differ after it. What the KV of a prefix may
be reused for is scoped, so that no caller learns anything another sent (not even from how fast the first token
came, or from `cached_tokens`; vLLM's cache_salt, CVE-2025-46570):
- a **scope** is a tenant (its API key) and, within it, a request's `cache_salt`; nothing crosses scopes;
- within a scope, the tokens before a caller's first words (the leading system messages and the template's text
  around them) are **shared** by every caller who sends exactly them, whole or not at all;
- a caller's **conversation** so far (its `user`) is reused only for that caller.

The store keeps decoder states (runtime/kv_state.py) by key, least recently used first out, bounded in bytes.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

from spectune.runtime.kv_state import DecoderState
from spectune.runtime.llama import common_prefix


@dataclass(frozen=True)
class Scope:
    """Who may share cached prefixes: one tenant (an API key), and one cache_salt within it."""

    tenant: str
    salt: str = ""


@dataclass(frozen=True)
class Caller:
    scope: Scope
    user: str | None  # None: a caller the server cannot tell apart from the next (its conversation is its own)


def shared_key(scope: Scope, tokens: list[int]) -> tuple[Scope, str]:
    return scope, "shared:" + hashlib.sha256(repr(tokens).encode()).hexdigest()


def conversation_key(caller: Caller) -> tuple[Scope, str] | None:
    return None if caller.user is None else (caller.scope, "user:" + caller.user)


class PrefixStore:
    """Decoder states by key; the least recently used go first past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[Scope, str], DecoderState] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()  # the slots' job threads read and write it

    def get(self, key: tuple[Scope, str] | None) -> DecoderState | None:
        with self.lock:
            if key is None or key not in self.entries:
                return None
            self.entries.move_to_end(key)
            return self.entries[key]

    def put(self, key: tuple[Scope, str] | None, state: DecoderState) -> None:
        if key is None or state.nbytes > self.max_bytes:
            return
        with self.lock:
            self._drop(key)
            self.entries[key] = state
            self.bytes += state.nbytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[Scope, str]) -> None:
        if (state := self.entries.pop(key, None)) is not None:
            self.bytes -= state.nbytes


@dataclass(frozen=True)
class Reuse:
    """Where a request's prefill starts from: `length` tokens of the slot's own cache, or of a stored state."""

    length: int
    state: DecoderState | None = None  # None: the slot's live cache


def usable(cached: tuple[int, ...] | list[int], prompt: list[int]) -> int:
    """Leading tokens of `prompt` a cache holding `cached` serves; the prompt's last token is always decoded anew
    (its logits give the first token)."""
    return common_prefix(list(cached), prompt[:-1])


def best_reuse(
    store: PrefixStore, caller: Caller, live_owner: Caller | None, live: list[int], prompt: list[int], shared: int
) -> Reuse:
    """The longest prefix of `prompt` this caller may reuse: the slot's own cache where it holds this caller's
    conversation, the caller's stored conversation, or the scope's stored shared prefix (whole or not at all)."""
    options = [Reuse(usable(live, prompt))] if caller.user is not None and live_owner == caller else []
    if (conversation := store.get(conversation_key(caller))) is not None:
        options.append(Reuse(usable(conversation.tokens, prompt), conversation))
    if shared and (common := store.get(shared_key(caller.scope, prompt[:shared]))) is not None:
        options.append(Reuse(usable(common.tokens, prompt), common))
    return max(options, key=lambda option: (option.length, option.state is None), default=Reuse(0))
