"""A decoder's caches as bytes in host memory: what a server keeps of a prompt prefix (a tenant's system prompt, a
caller's conversation so far) to restore into whichever slot serves the next request, through llama.cpp's own
sequence-state API (llama_state_seq_get_data / set_data: the KV cells of the sequence, as they were computed, so a
restored prefix decodes on exactly as it would have)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from spectune.errors import SpectuneError
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder

SEQUENCE = 0  # every LlamaModel holds one sequence


@dataclass(frozen=True)
class ModelState:
    tokens: tuple[int, ...]  # the positions the KV covers
    kv: bytes
    # what the model keeps per position beside its KV (an EAGLE-3 head's layer inputs, an MTP assistant's states)
    layer_inputs: np.ndarray
    hidden_states: np.ndarray

    @property
    def nbytes(self) -> int:
        return len(self.kv) + self.layer_inputs.nbytes + self.hidden_states.nbytes + 4 * len(self.tokens)


def save_model(model: LlamaModel) -> ModelState:
    with model.busy:
        size = model.lib.llama_state_seq_get_size(model.ctx, SEQUENCE)
        buffer = (ctypes.c_uint8 * size)()
        written = model.lib.llama_state_seq_get_data(model.ctx, buffer, size, SEQUENCE)
        count = len(model.cached)
        return ModelState(
            tuple(model.cached),
            bytes(buffer)[:written],
            model.layer_inputs[:count].copy(),
            model.hidden_states[:count].copy(),
        )


def load_model(model: LlamaModel, state: ModelState) -> None:
    with model.busy:
        model.truncate(0)
        buffer = (ctypes.c_uint8 * len(state.kv)).from_buffer_copy(state.kv)
        if model.lib.llama_state_seq_set_data(model.ctx, buffer, len(state.kv), SEQUENCE) == 0:
            raise SpectuneError(f"{model.path}: llama.cpp could not restore a saved prefix of {len(state.tokens)}")
        model.cached = list(state.tokens)
        count = len(state.tokens)
        if len(model.layer_inputs):
            model.layer_inputs[:count] = state.layer_inputs
        if len(model.hidden_states):
            model.hidden_states[:count] = state.hidden_states


def own_caches(decoder: SpeculativeDecoder) -> list[LlamaModel]:
    """The target, then each speculator model with a KV cache of its own (an MTP assistant reads the target's)."""
    return [decoder.target, *(m for m in decoder.speculators.models if not m.kind.reads_target_cache)]


@dataclass(frozen=True)
class DecoderState:
    models: tuple[ModelState, ...]  # own_caches' order

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.models[0].tokens

    @property
    def nbytes(self) -> int:
        return sum(model.nbytes for model in self.models)


def save_decoder(decoder: SpeculativeDecoder) -> DecoderState:
    """The target's cache, and each speculator model's cut to what it shares with the target's (the rest would be
    another prompt's)."""
    target, *drafts = own_caches(decoder)
    for model in drafts:
        model.truncate(min(len(model.cached), model.reusable_prefix(target.cached)))
    return DecoderState(tuple(save_model(model) for model in [target, *drafts]))


def load_decoder(decoder: SpeculativeDecoder, state: DecoderState) -> None:
    """Every cache as saved; what the lookups learned is dropped (it was of whatever the slot held before)."""
    decoder.speculators.forget()
    for model, saved in zip(own_caches(decoder), state.models, strict=True):
        load_model(model, saved)
