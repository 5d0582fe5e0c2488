"""An EAGLE-3 head as a speculator: one decoder layer that drafts from the target's own hidden states.

It reads the inputs of three target layers at every position the target decoded (LlamaModel.keep_layer_inputs,
through layer_inputs.cpp), fuses them into one state g per position (the head's encoder), and its decoder layer
reads at position P the pair (token P+1, g P), as llama.cpp's common/speculative.cpp feeds it. So when the target
has decoded every token but the last, the head can catch up to the last pair and guess the next token; each further
guess reads (the guess, the head's own state of the step before). Those guessed pairs are not the target's, so the
next proposal rolls the head back to the pairs the target's states gave it (`self.tokens`).

The head borrows the target's token embeddings (and its output matrix where it has none of its own) through the
context it was loaded beside; its logits span the target's vocabulary (llama.cpp maps the head's own to it).
"""

from __future__ import annotations

import ctypes
import time
import weakref

import numpy as np

from spectune.errors import SpectuneError
from spectune.llama_cpp_pin import HEAD_TARGETS
from spectune.runtime.draft_kinds import EAGLE3_HEAD
from spectune.runtime.draft_model import DRAFT, draft_chain
from spectune.runtime.layer_inputs import shim
from spectune.runtime.llama import LlamaModel, common_prefix
from spectune.runtime.sampling import Sampler
from spectune.runtime.speculators import Proposal

HEAD_LAYERS = 3  # EAGLE-3 reads a low, a middle and a high layer of its target


class Eagle3Head:
    name = DRAFT

    def __init__(self, model: LlamaModel, target: LlamaModel) -> None:
        if model.kind is not EAGLE3_HEAD:
            raise SpectuneError(f"{model.path} is no EAGLE-3 head")
        if model.n_vocab != target.n_vocab:
            raise SpectuneError(f"{model.path}: {model.n_vocab} tokens, its target {target.n_vocab}: not its head")
        architecture = target.metadata("general.architecture")
        if architecture not in HEAD_TARGETS:  # llama.cpp would abort the process at the first decode
            raise SpectuneError(
                f"{target.path}: a {architecture} target; the pinned llama.cpp hands over layer inputs, what an "
                f"EAGLE-3 head reads, only for {', '.join(HEAD_TARGETS)}"
            )
        library = shim()
        count = library.spectune_head_layer_count(model.model)
        if count != HEAD_LAYERS:
            raise SpectuneError(f"{model.path}: reads {count} target layers, an EAGLE-3 head reads {HEAD_LAYERS}")
        layers = library.spectune_head_layers(model.model)
        target.keep_layer_inputs([layers[i] for i in range(count)])
        self.model, self.target, self.library = model, target, library
        self.batch = model.lib.llama_batch_ext_init(model.ctx)
        weakref.finalize(self, model.lib.llama_batch_ext_free, self.batch)  # the batch owns only its own buffers
        # the conversation the head's kept pairs rest on: its positions 0..len-2 hold the target's own pairs
        self.tokens: list[int] = []
        self.state = np.zeros(model.n_embd, dtype=np.float32)  # the head's hidden state of its last decoded pair

    def behind(self, sequence: list[int]) -> int:
        return len(sequence) - 1 - self._reusable(sequence)

    def _reusable(self, sequence: list[int]) -> int:
        """Kept pairs still true of `sequence`: pair P rests on its tokens 0..P+1. The last pair is always read
        again, for its output."""
        return max(0, min(common_prefix(self.tokens, sequence), len(sequence) - 1) - 1)

    def propose(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        """Up to k tokens after `sequence`, whose tokens but the last the target has decoded."""
        start = time.perf_counter()
        last = len(sequence) - 2  # the last position whose target states exist
        if last < 0 or len(self.target.cached) <= last or self.target.cached[: last + 1] != sequence[: last + 1]:
            return Proposal(source=DRAFT)  # the target has not read the conversation (yet): nothing to draft from
        reused = self._reusable(sequence)
        self.model.truncate(reused)
        states = self._encode(self.target.layer_inputs[reused : last + 1])
        logits = self._decode(sequence[reused + 1 : last + 2], states, reused)
        self.tokens = sequence[:]
        proposal = Proposal(source=DRAFT, caught_up=(last + 1 - reused, time.perf_counter() - start))

        def next_logits(token: int) -> np.ndarray:  # the pair (the guess, the head's state of the step before)
            return self._decode([token], self.state[None, :], last + len(proposal.tokens))

        return draft_chain(proposal, logits, next_logits, k, sampler, p_min, self.target.is_end)

    def verified(self, proposal: Proposal, accepted: int) -> None:
        """Nothing to learn: the next proposal reads the target's states of what it kept."""

    def forget(self) -> None:
        self.model.truncate(0)
        self.tokens = []

    def _encode(self, features: np.ndarray) -> np.ndarray:
        """The fused state g of each position's target features, rows in order."""
        lib, states = self.model.lib, np.empty((len(features), self.model.n_embd), dtype=np.float32)
        features = np.ascontiguousarray(features)
        for offset in range(0, len(features), self.model.n_batch):
            chunk = features[offset : offset + self.model.n_batch]
            lib.llama_batch_ext_clear(self.batch)
            placeholder = len(self.model.cached)  # the encoder reads no position; llama.cpp's own loop gives these
            for row in range(len(chunk)):
                index = lib.llama_batch_ext_add_embd(self.batch, 0, _embd(chunk[row : row + 1]))
                lib.llama_batch_ext_set_pos(self.batch, index, ctypes.byref(lib.llama_pos(placeholder + row)))
                lib.llama_batch_ext_set_output_logits(self.batch, index, True)
            self._process(lib.LLAMA_PROCESS_TYPE_ENCODE, offset)
            pointer = self.library.spectune_hidden_states(self.model.ctx)
            states[offset : offset + len(chunk)] = np.ctypeslib.as_array(pointer, shape=(len(chunk), self.model.n_embd))
        return states

    def _decode(self, tokens: list[int], states: np.ndarray, start: int) -> np.ndarray:
        """Read the pairs (tokens[i], states[i]) at positions start..; the last one's logits (valid until the next
        decode), its hidden state kept as `self.state`.

        The last pair goes alone, as llama.cpp's loop seeds its drafts: the head's graph keeps the rows of every
        pair in a batch, not only of those asked for, so llama.cpp hands back the first rows, not the last (read:
        the state of a 2-pair batch's output differed from two 1-pair batches' by more than its own size)."""
        model = self.model
        model.truncate(start)
        states = np.ascontiguousarray(states, dtype=np.float32)
        for offset in range(0, len(tokens) - 1, model.n_batch):
            end = min(offset + model.n_batch, len(tokens) - 1)
            self._decode_batch(tokens[offset:end], states[offset:end], start + offset, output=False)
        self._decode_batch(tokens[-1:], states[-1:], start + len(tokens) - 1, output=True)
        logits = np.ctypeslib.as_array(model.lib.llama_get_logits_ith(model.ctx, 0), shape=(model.n_vocab,))
        state = np.ctypeslib.as_array(self.library.spectune_hidden_state(model.ctx, 0), shape=(model.n_embd,))
        self.state = state.copy()
        return logits

    def _decode_batch(self, tokens: list[int], states: np.ndarray, start: int, output: bool) -> None:
        lib = self.model.lib
        lib.llama_batch_ext_clear(self.batch)
        for row, token in enumerate(tokens):
            index = lib.llama_batch_ext_add_token(self.batch, 0, token)
            lib.llama_batch_ext_set_pos(self.batch, index, ctypes.byref(lib.llama_pos(start + row)))
            lib.llama_batch_ext_set_embd_token(self.batch, index, _embd(states[row : row + 1]))
        lib.llama_batch_ext_set_output_logits(self.batch, len(tokens) - 1, output)
        self._process(lib.LLAMA_PROCESS_TYPE_DECODE, start)
        self.model.cached += tokens

    def _process(self, kind: int, position: int) -> None:
        status = self.model.lib.llama_process(self.model.ctx, kind, self.batch)
        if status != 0:
            raise SpectuneError(f"{self.model.path}: the EAGLE-3 head failed (status {status}) at position {position}")


def _embd(rows: np.ndarray):
    """llama.cpp's view of contiguous float32 rows (it reads them during the next llama_process)."""
    import llama_cpp

    return llama_cpp.llama_embd(rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), rows.shape[0], rows.shape[1])
