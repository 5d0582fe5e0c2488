"""A thin wrapper over llama.cpp's low-level API (through llama-cpp-python): load a GGUF, tokenize,
decode a batch of tokens at given positions, read logits, and roll the KV cache back.

`exact=True` makes batched logits match one-token logits on the CPU backend: no weight repacking
(`use_extra_bufts = False`, llama.cpp's --no-repack) and no flash attention (its batched kernel differed from the
one-token one by up to 0.03 in the logits past a few hundred tokens of context; without it the difference is ~1e-6),
so speculative greedy output equals plain greedy output at 4 bits. It costs 8–29% per token (docs/identity.md).

The tiled K-quant matmul is off in a process unless it decodes only at the fastest settings (`use_tiled_matmul`:
`spectune serve --mode fastest`, or auto's choice of it, measured in a child process: runtime/mode.py): ggml reads
GGML_CPU_TILED_MM once, at the first batched matmul, and keeps it for the life of the process, so a non-exact model
that ran first (seqkd's answer generation before the bench, in one `spectune run`) left it on for every exact model
after it. It only changes batched (prefill) numerics, so the answers then differed from llama.cpp's own on 9 of 20
tuned-Gemma prompts.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spectune.cache import compiled_library
from spectune.errors import SpectuneError
from spectune.runtime.build import build_features, gguf_field
from spectune.runtime.draft_kinds import DraftKind, kind_of
from spectune.runtime.layer_inputs import shim
from spectune.threads import ALL_LAYERS, DEFAULT_N_CTX, thread_count

_backend_ready = False
_tiled_matmul = False
ABORT_SOURCE = Path(__file__).with_name("abort_flag.c")
DECODE_ABORTED = 2  # llama_decode's status when the abort callback said stop


class DecodeAborted(SpectuneError):
    """A decode cut short by LlamaModel.abort (the server is stopping)."""


@functools.cache  # one compiled function per process
def abort_check() -> object | None:
    """abort_flag.c's function as llama.cpp's abort callback, or None where no C compiler can build it (then a
    stopping server waits for the batch in progress, as before)."""
    import llama_cpp

    try:
        library = ctypes.CDLL(str(compiled_library(ABORT_SOURCE, "cc", [])))
    except (SpectuneError, OSError):
        return None
    return llama_cpp.ggml_abort_callback(ctypes.cast(library.spectune_abort_requested, ctypes.c_void_p).value)


def use_tiled_matmul() -> None:
    """For a process that decodes only at llama.cpp's fastest settings: ggml's tiled K-quant matmul on, as llama.cpp's
    own tools have it (faster batched prefill: docs/results.md). Before the process's first decode."""
    global _tiled_matmul
    _tiled_matmul = True


def init_backend() -> None:
    """Initialise libllama once, with its logging silenced (errors surface as SpectuneError instead)."""
    global _backend_ready
    import llama_cpp

    # process-wide, read once by ggml (see the module's docstring)
    os.environ["GGML_CPU_TILED_MM"] = "1" if _tiled_matmul else "0"
    if not _backend_ready and os.environ.get("SPECTUNE_LLAMA_LOG"):  # debugging: keep llama.cpp's own log
        llama_cpp.llama_backend_init()
        _backend_ready = True
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _silence = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_silence, ctypes.c_void_p())
        init_backend.callback = _silence  # keep the callback alive
        _backend_ready = True


def _amx_compiled() -> bool:
    """Whether this llama.cpp has the AMX extra buffer type (Intel Xeon with AMX, built native). Its kernels crashed
    (SIGSEGV) on every batch of 2+ tokens of the tests' small Q4_K_M and Q8_0 models on a Xeon with AMX granted by
    the kernel, so a non-exact model keeps the plain weights there (repacking is then off as well)."""
    return build_features().get("AMX_INT8") == "1"


class _Handles:
    """libllama's handles of one model and the lock that keeps them alive while they are in use: freeing (close(),
    the garbage collector, or interpreter exit, when a worker thread may still be generating) waits for the user."""

    def __init__(self, lib, batch, ctx, model) -> None:
        self.lib, self.batch, self.ctx, self.model = lib, batch, ctx, model
        self.lock = threading.RLock()
        self.open = True

    def free(self) -> None:
        with self.lock:
            if self.open:
                self.open = False
                self.lib.llama_batch_free(self.batch)
                self.lib.llama_free(self.ctx)
                self.lib.llama_model_free(self.model)


class LlamaModel:
    """One GGUF model with one context (one sequence)."""

    def __init__(
        self,
        path: str | Path,
        n_ctx: int = DEFAULT_N_CTX,
        threads: int | None = None,
        exact: bool = True,
        n_batch: int = 512,
        beside: LlamaModel | None = None,
        gpu_layers: int = ALL_LAYERS,
    ) -> None:
        """`beside`: the target a head runs beside (an EAGLE-3 head borrows the target's token embeddings and reads
        its layer inputs: runtime/eagle3_head.py; an MTP assistant reads its KV cache); ignored for any other GGUF.
        `gpu_layers`: layers offloaded to the GPU (-1: every one; a CPU build of llama.cpp runs them all here)."""
        import llama_cpp

        self.path = Path(path)
        if not self.path.is_file():
            raise SpectuneError(f"{self.path}: no such GGUF file")
        self.architecture = gguf_architecture(self.path)
        self.kind = kind_of(self.architecture)  # what it is as a draft (any GGUF may be one)
        if self.is_head and beside is None:
            raise SpectuneError(f"{self.path} is {self.kind.words}: it runs only beside its target, as its draft")
        init_backend()
        self.lib = llama_cpp
        self.exact = exact
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = not exact and not _amx_compiled()
        model_params.n_gpu_layers = gpu_layers
        self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self.model:
            raise SpectuneError(f"{self.path}: llama.cpp could not load this GGUF")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.bos, self.eos = llama_cpp.llama_vocab_bos(self.vocab), llama_cpp.llama_vocab_eos(self.vocab)
        self.adds_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))  # what llama.cpp's tools do to a prompt
        self.threads = thread_count(threads)
        self._abort_requested = ctypes.c_bool(False)  # read by abort_flag.c between graph nodes
        self._stopped, self._flag_lock = False, threading.Lock()  # _stopped: abort() was called, the flag stays set
        self.ctx = llama_cpp.llama_init_from_model(self.model, self._context_params(n_ctx, n_batch, exact, beside))
        if not self.ctx:
            raise SpectuneError(f"{self.path}: llama.cpp could not create a context of {n_ctx} tokens")
        if self.is_head:
            shim().spectune_keep_hidden_state(self.ctx)
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.device = device_of(llama_cpp, llama_cpp.llama_model_n_layer(self.model), gpu_layers)
        self.kept_layers: list[int] = []  # layers whose inputs every decode keeps (an EAGLE-3 head's target)
        self.layer_inputs = np.zeros((0, 0), dtype=np.float32)  # [position, kept layer x n_embd]
        self.hidden_states = np.zeros((0, 0), dtype=np.float32)  # [position, n_embd]: an MTP assistant's target
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        # llama.cpp clamps the batch to the context: chunk by what it really took.
        self.n_batch = min(llama_cpp.llama_n_batch(self.ctx), llama_cpp.llama_n_ubatch(self.ctx))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.cached: list[int] = []  # the tokens whose KV this context holds, position by position

        # finalize (not __del__) runs before interpreter shutdown tears the bindings down; it waits for `busy`.
        self._handles = _Handles(llama_cpp, self.batch, self.ctx, self.model)
        self.busy = self._handles.lock  # held by whoever decodes and reads logits (a generation holds it throughout)
        self._finalizer = weakref.finalize(self, self._handles.free)

    @property
    def is_head(self) -> bool:
        """A draft that runs only beside its target (its context reads the target's)."""
        return self.kind.beside_target

    def _context_params(self, n_ctx: int, n_batch: int, exact: bool, beside: LlamaModel | None):
        params = self.lib.llama_context_default_params()
        if self.is_head and beside is not None:
            params.ctx_other = beside.ctx
        if self.kind.reads_target_cache:
            params.ctx_type = self.lib.LLAMA_CONTEXT_TYPE_MTP
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        # Both set explicitly: the default batch thread count stalled ~0.5 s per batch on 2 cores.
        params.n_threads = params.n_threads_batch = self.threads
        if exact:
            params.flash_attn_type = self.lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if (check := abort_check()) is not None:
            params.abort_callback = check
            params.abort_callback_data = ctypes.cast(ctypes.pointer(self._abort_requested), ctypes.c_void_p)
        return params

    def close(self) -> None:
        self._finalizer()

    def abort(self) -> None:
        """From any thread: cut the decode in progress within a graph node, and refuse every later one
        (DecodeAborted). For a model that will not decode again: its server is stopping."""
        with self._flag_lock:
            self._stopped = True
            self._abort_requested.value = True

    def interrupt(self, cut: bool) -> None:
        """From any thread: cut=True cuts the decode in progress within a graph node and refuses every later one
        (DecodeAborted) until interrupt(False); an abort() stays. For work that yields to a caller at once."""
        with self._flag_lock:
            self._abort_requested.value = cut or self._stopped

    def memory_bytes(self) -> int:
        """What one more load of this model costs in memory, about: its f16 KV cache for n_ctx, and its weights again
        where they are repacked (exact off: a copy per load; exact: mmapped pages every load shares)."""
        lib, model = self.lib, self.model
        head_dim = self.n_embd // max(1, lib.llama_model_n_head(model))
        kv = 2 * 2 * self.n_ctx * lib.llama_model_n_layer(model) * lib.llama_model_n_head_kv(model) * head_dim
        return kv + (0 if self.exact else self.path.stat().st_size)

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text, whatever its length (chat templates run to tens of kB)."""
        length = self.lib.llama_model_meta_val_str(self.model, key.encode(), None, 0)  # snprintf-style: the size
        if length < 0:
            return None
        buffer = ctypes.create_string_buffer(length + 1)
        self.lib.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode("utf-8")

    def keep_layer_inputs(self, layers: list[int]) -> None:
        """From now on, keep the inputs of these layers at every decoded position (what an EAGLE-3 head reads). The
        cache is forgotten, so that every cached position has them."""
        n_layer = self.lib.llama_model_n_layer(self.model)
        outside = [layer for layer in layers if not 0 <= layer < n_layer]
        if outside:
            raise SpectuneError(f"{self.path}: layers {outside} asked for, the model has {n_layer} (0-{n_layer - 1})")
        for layer in layers:
            shim().spectune_keep_layer_input(self.ctx, layer)
        self.kept_layers = list(layers)
        self.layer_inputs = np.zeros((self.n_ctx, len(layers) * self.n_embd), dtype=np.float32)
        self.truncate(0)

    def keep_hidden_states(self) -> None:
        """From now on, keep the post-norm hidden state at every decoded position (what an MTP assistant reads). The
        cache is forgotten, so that every cached position has one."""
        shim().spectune_keep_all_hidden_states(self.ctx)
        self.hidden_states = np.zeros((self.n_ctx, self.n_embd), dtype=np.float32)
        self.truncate(0)

    def _copy_hidden_states(self, start: int, count: int) -> None:
        pointer = shim().spectune_hidden_states(self.ctx)
        if not pointer:
            raise SpectuneError(f"{self.path}: llama.cpp kept no hidden states (not a Gemma 4 target?)")
        self.hidden_states[start : start + count] = np.ctypeslib.as_array(pointer, shape=(count, self.n_embd))

    def _copy_layer_inputs(self, start: int, count: int) -> None:
        for index, layer in enumerate(self.kept_layers):
            pointer = shim().spectune_layer_input(self.ctx, layer)
            if not pointer:
                raise SpectuneError(f"{self.path}: llama.cpp kept no input of layer {layer} (an unpatched build?)")
            rows = np.ctypeslib.as_array(pointer, shape=(count, self.n_embd))
            self.layer_inputs[start : start + count, index * self.n_embd : (index + 1) * self.n_embd] = rows

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Tokens of `text`; `special` parses control tokens such as <|im_start|> (as HF does)."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        tokens = (self.lib.llama_token * capacity)()
        count = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, capacity, False, special)
        if count < 0:
            raise SpectuneError(f"tokenization needs {-count} tokens, more than {capacity}")
        return list(tokens[:count])

    def piece(self, token: int, special: bool = True) -> bytes:
        """A token's bytes; `special` renders control tokens such as <|im_start|> (an answer's text does not, as
        vLLM's skip_special_tokens)."""
        buffer = ctypes.create_string_buffer(256)
        length = self.lib.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, special)
        return buffer.raw[: max(length, 0)]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_end(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    @functools.cached_property
    def end_tokens(self) -> np.ndarray:
        """Every end-of-generation token id (what min_tokens and ignore_eos keep the target from choosing)."""
        return np.array([token for token in range(self.n_vocab) if self.is_end(token)], dtype=np.int64)

    def decode(self, tokens: list[int], start: int, all_logits: bool = True, copy: bool = True) -> np.ndarray:
        """Decode `tokens` at positions start.. and return logits (rows: every token, or only the last).

        copy=False returns a view of llama.cpp's logits buffer where one batch holds them all: valid only until
        this model's next decode, for a caller that reads it at once (at 262k entries a row is 1 MB)."""
        with self.busy:
            return self._decode(tokens, start, all_logits, copy)

    def _decode(self, tokens: list[int], start: int, all_logits: bool, copy: bool) -> np.ndarray:
        if not self._handles.open:
            raise SpectuneError(f"{self.path}: the model was closed")
        if start + len(tokens) > self.n_ctx:
            raise SpectuneError(f"context full: {start + len(tokens)} tokens > n_ctx {self.n_ctx}")
        if start > len(self.cached):
            raise SpectuneError(f"decode at position {start} leaves a gap after {len(self.cached)} cached tokens")
        self.truncate(start)
        self.cached += tokens
        rows = []
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset : offset + self.n_batch]
            last_chunk = offset + self.n_batch >= len(tokens)
            batch = self.batch
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = start + offset + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or (last_chunk and i == len(chunk) - 1)
            status = self.lib.llama_decode(self.ctx, batch)
            if status == DECODE_ABORTED:
                self.truncate(start + offset)  # the batches before this one stay cached, whole
                raise DecodeAborted(f"{self.path}: decode aborted at position {start + offset}")
            if status != 0:
                raise SpectuneError(f"llama_decode failed (status {status}) at position {start + offset}")
            if self.kept_layers:
                self._copy_layer_inputs(start + offset, len(chunk))
            if len(self.hidden_states):
                self._copy_hidden_states(start + offset, len(chunk))
            if all_logits or last_chunk:  # all_logits: this batch's outputs, contiguous in the order asked
                if all_logits:
                    pointer = self.lib.llama_get_logits(self.ctx)
                else:
                    pointer = self.lib.llama_get_logits_ith(self.ctx, len(chunk) - 1)
                view = np.ctypeslib.as_array(pointer, shape=(len(chunk) if all_logits else 1, self.n_vocab))
                rows.append(view.copy() if copy or not last_chunk else view)  # the next batch overwrites it
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def truncate(self, length: int) -> None:
        """Forget every cached position >= `length` (roll back rejected draft tokens)."""
        with self.busy:
            if length < len(self.cached) and self._handles.open:
                self.lib.llama_memory_seq_rm(self.memory, 0, length, -1)
                del self.cached[length:]

    def reusable_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the cache already holds (a new turn of a conversation reuses them)."""
        return common_prefix(self.cached, tokens)


def device_of(lib, layers: int, gpu_layers: int) -> str:
    """Where a model's layers run: on the CPU, or so many of them on the GPU (the rest on the CPU)."""
    if not lib.llama_supports_gpu_offload() or gpu_layers == 0:
        return "CPU"
    offloaded = layers if gpu_layers < 0 else min(gpu_layers, layers)
    return f"GPU ({offloaded}/{layers} layers)"


def common_prefix(have: list[int], want: list[int]) -> int:
    """How many leading tokens the two lists share."""
    length = min(len(have), len(want))
    if have[:length] == want[:length]:  # the usual case, compared in C: the step loop calls this
        return length
    return next(i for i, (mine, theirs) in enumerate(zip(have, want, strict=False)) if mine != theirs)


@dataclass
class VocabInfo:
    """What llama.cpp checks before it accepts two models as a speculative pair."""

    path: Path
    vocab_type: int
    n_tokens: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    texts: list[bytes]


def read_vocab(path: str | Path) -> VocabInfo:
    """Load only the vocabulary of a GGUF (no weights)."""
    import llama_cpp

    init_backend()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise SpectuneError(f"{path}: llama.cpp could not load this GGUF")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        count = llama_cpp.llama_vocab_n_tokens(vocab)
        return VocabInfo(
            path=Path(path),
            vocab_type=llama_cpp.llama_vocab_type(vocab),
            n_tokens=count,
            bos=llama_cpp.llama_vocab_bos(vocab),
            eos=llama_cpp.llama_vocab_eos(vocab),
            add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
            add_eos=bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
            texts=[llama_cpp.llama_vocab_get_text(vocab, i) or b"" for i in range(count)],
        )
    finally:
        llama_cpp.llama_model_free(model)


def gguf_architecture(path: str | Path) -> str | None:
    return gguf_field(path, "general.architecture")


def draft_kind(path: str | Path) -> DraftKind:
    """What a draft GGUF is (runtime/draft_kinds.py), from its architecture, without loading it."""
    return kind_of(gguf_architecture(path))


def spec_type(draft: str | Path) -> str:
    """llama.cpp's `--spec-type` for a draft GGUF."""
    return draft_kind(draft).spec_type
