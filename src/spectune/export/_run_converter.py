"""Subprocess entry: run llama.cpp's convert_hf_to_gguf.py from its cached folder.

Usage: python -m spectune.export._run_converter CONVERTER_DIR PRE_TOKENIZER MODEL_DIR [converter args]
A non-empty PRE_TOKENIZER names the llama.cpp pre-tokenizer a spectune-made tokenizer uses; the converter
recognises pre-tokenizers only by hashes of known vocabularies, so it is told instead of guessing.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    folder, pre_tokenizer, *converter_args = sys.argv[1:]
    sys.path[:0] = [folder, str(Path(folder) / "gguf-py")]
    if pre_tokenizer:
        from conversion.base import TextModel

        TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer
    sys.argv = [str(Path(folder) / "convert_hf_to_gguf.py"), *converter_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
