"""Gemma 4's MTP assistant as a speculator in spectune's loop, run through llama.cpp's API as its own
`draft-mtp` runs it (common/speculative.cpp of the pinned sources).

The assistant's context is of llama.cpp's MTP type with the target's context as `ctx_other`: it keeps no KV of its
own and attends to the target's. The target keeps the post-norm hidden state of every position it decodes
(LlamaModel.keep_hidden_states). To draft after `sequence` (whose last token the target has not decoded), the
assistant reads the pair (that token, the target's state of the position before) at the last token's position; each
further guess reads (the guess, the assistant's own projected state) at that same position. So there is nothing to
catch up on and nothing to roll back: every proposal starts from the target's states of what it kept.
"""

from __future__ import annotations

import ctypes
import time
import weakref

import numpy as np

from spectune.errors import SpectuneError
from spectune.runtime.draft_kinds import MTP_ASSISTANT
from spectune.runtime.draft_model import DRAFT, draft_chain
from spectune.runtime.layer_inputs import shim
from spectune.runtime.llama import LlamaModel
from spectune.runtime.sampling import Sampler
from spectune.runtime.speculators import Proposal

TARGET_ARCHITECTURES = ("gemma4",)  # targets whose graph hands its hidden states to an assistant (t_h_nextn)


class MtpAssistant:
    name = DRAFT

    def __init__(self, model: LlamaModel, target: LlamaModel) -> None:
        if model.kind is not MTP_ASSISTANT:
            raise SpectuneError(f"{model.path} is no Gemma 4 MTP assistant")
        if target.architecture not in TARGET_ARCHITECTURES:
            raise SpectuneError(f"{target.path}: a {target.architecture} target; an MTP assistant drafts for Gemma 4")
        width = model.lib.llama_model_n_embd_out(model.model)
        if width != target.n_embd or model.n_vocab != target.n_vocab:
            raise SpectuneError(
                f"{model.path} reads states {width} wide over {model.n_vocab} tokens; its target {target.path} has "
                f"{target.n_embd} and {target.n_vocab}: not its assistant"
            )
        target.keep_hidden_states()
        self.model, self.target, self.library = model, target, shim()
        self.batch = model.lib.llama_batch_ext_init(model.ctx)
        weakref.finalize(self, model.lib.llama_batch_ext_free, self.batch)
        self.state = np.zeros(width, dtype=np.float32)  # the pair's state row, alive while llama.cpp reads it

    def behind(self, sequence: list[int]) -> int:
        return 0

    def propose(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        """Up to k tokens after `sequence`, whose tokens but the last the target has decoded."""
        start = time.perf_counter()
        last = len(sequence) - 2  # the last position whose target state exists
        if last < 0 or len(self.target.cached) <= last or self.target.cached[: last + 1] != sequence[: last + 1]:
            return Proposal(source=DRAFT)  # the target has not read the conversation (yet): nothing to draft from
        position = last + 1
        # llama.cpp places the assistant's query after the last position in the shared cache: anything the target
        # holds past the conversation (a rejected step's rows) goes first, as the loop would drop it anyway.
        self.target.truncate(position)
        logits = self._step(sequence[-1], self.target.hidden_states[last], position)
        proposal = Proposal(source=DRAFT, caught_up=(0, time.perf_counter() - start))

        def next_logits(token: int) -> np.ndarray:
            return self._step(token, self.state, position)

        return draft_chain(proposal, logits, next_logits, k, sampler, p_min, self.target.is_end)

    def verified(self, proposal: Proposal, accepted: int) -> None:
        """Nothing to learn: the next proposal reads the target's state of the last token it kept."""

    def forget(self) -> None:
        """Nothing held: the assistant's cache is the target's."""

    def _step(self, token: int, state: np.ndarray, position: int) -> np.ndarray:
        """Read (token, state) at `position`: its logits (valid until the next step); its projected state kept."""
        import llama_cpp

        lib, row = self.model.lib, np.ascontiguousarray(state, dtype=np.float32)[None, :]
        with self.model.busy, self.target.busy:
            lib.llama_batch_ext_clear(self.batch)
            index = lib.llama_batch_ext_add_token(self.batch, 0, token)
            lib.llama_batch_ext_set_pos(self.batch, index, ctypes.byref(lib.llama_pos(position)))
            embd = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[1])
            lib.llama_batch_ext_set_embd_token(self.batch, index, embd)
            lib.llama_batch_ext_set_output_logits(self.batch, index, True)
            status = lib.llama_process(self.model.ctx, lib.LLAMA_PROCESS_TYPE_DECODE, self.batch)
            if status != 0:
                raise SpectuneError(f"{self.model.path}: the assistant failed (status {status}) at position {position}")
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.model.ctx, 0), shape=(self.model.n_vocab,))
            pointer = self.library.spectune_hidden_state(self.model.ctx, 0)
            self.state = np.ctypeslib.as_array(pointer, shape=(len(self.state),)).copy()
        return logits
