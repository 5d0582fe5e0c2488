"""The C shim (layer_inputs.cpp) through which a head reads its target's states and runs beside it: an EAGLE-3 head
(the target's layer inputs) or Gemma 4's MTP assistant (the target's last hidden states).

It is compiled once per shim source and per libllama (the binding's version names the build, patches included), into
the user cache, against the library the binding itself loaded: its functions then act on the binding's own contexts.
The pinned llama.cpp must carry spectune's layer-input patch for Qwen2 and Gemma 3 targets (llama_cpp_patch.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from spectune.cache import compiled_library
from spectune.errors import SpectuneError

SOURCE = Path(__file__).with_name("layer_inputs.cpp")


def _libllama() -> Path:
    import llama_cpp

    library = Path(llama_cpp.__file__).parent / "lib" / "libllama.so"
    if not library.exists():
        raise SpectuneError(f"{library}: the binding's libllama is not where the shim links to it")
    return library


def shim_path() -> Path:
    """The shim compiled for this source and this libllama, built on first use."""
    import llama_cpp

    folder = _libllama().parent
    flags = [f"-L{folder}", "-lllama", f"-Wl,-rpath,{folder}", "-Wl,--no-undefined"]  # every function found now
    hint = f" against {folder / 'libllama.so'} (a libllama without the EAGLE-3 functions of the pinned llama.cpp?)"
    return compiled_library(SOURCE, "c++", flags, salt=llama_cpp.__version__, hint=hint)


@functools.cache  # one handle per process: the functions are the same for every context
def shim() -> ctypes.CDLL:
    library = ctypes.CDLL(str(shim_path()))
    context, model = ctypes.c_void_p, ctypes.c_void_p
    floats = ctypes.POINTER(ctypes.c_float)
    signatures = {
        "spectune_keep_layer_input": ([context, ctypes.c_uint32], None),
        "spectune_layer_input": ([context, ctypes.c_uint32], floats),
        "spectune_keep_hidden_state": ([context], None),
        "spectune_keep_all_hidden_states": ([context], None),
        "spectune_hidden_states": ([context], floats),
        "spectune_hidden_state": ([context, ctypes.c_int32], floats),
        "spectune_head_layers": ([model], ctypes.POINTER(ctypes.c_int32)),
        "spectune_head_layer_count": ([model], ctypes.c_uint32),
    }
    for name, (arguments, result) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, result
    return library
