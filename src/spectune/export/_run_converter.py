"""Subprocess entry: run llama.cpp's convert_hf_to_gguf.py from its cached folder.

Usage: python -m spectune.export._run_converter CONVERTER_DIR PRE_TOKENIZER MODEL_DIR [converter args]
A non-empty PRE_TOKENIZER names the llama.cpp pre-tokenizer a spectune-made tokenizer uses; the converter
recognises pre-tokenizers only by hashes of known vocabularies, so it is told instead of guessing.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

from sentencepiece import sentencepiece_model_pb2 as spm


def keep_user_defined_pieces(text_model: Any) -> None:
    """Make the converter keep tokenizer.model's user-defined pieces user-defined.

    It reads them only from tokenizer_config.json's added_tokens_decoder, which a folder imported from a GGUF does
    not have (transformers 5 writes none, and declaring them there changes how HF itself tokenizes). Left NORMAL,
    Gemma's whitespace and newline runs become BPE pieces and llama.cpp splits '  Glad' as ' ', ' Glad' where HF
    keeps '  ', 'Glad'. Spaces are pre-normalized as the converter does for the pieces it is told about."""
    from conversion.base import SentencePieceTokenTypes  # the converter's own package, on sys.path by now

    create_vocab = text_model._create_vocab_sentencepiece

    def create_vocab_keeping_user_defined(self: Any) -> tuple[list[bytes], list[float], list[int]]:
        tokens, scores, toktypes = create_vocab(self)
        proto = spm.ModelProto()
        proto.ParseFromString((self.dir_model / "tokenizer.model").read_bytes())
        for token_id, piece in enumerate(proto.pieces[: len(toktypes)]):
            user_defined = piece.type == spm.ModelProto.SentencePiece.USER_DEFINED
            if user_defined and toktypes[token_id] == SentencePieceTokenTypes.NORMAL:
                toktypes[token_id] = SentencePieceTokenTypes.USER_DEFINED
                tokens[token_id] = piece.piece.replace("\u2581", " ").encode("utf-8")
        return tokens, scores, toktypes

    text_model._create_vocab_sentencepiece = create_vocab_keeping_user_defined


def main() -> None:
    folder, pre_tokenizer, *converter_args = sys.argv[1:]
    sys.path[:0] = [folder, str(Path(folder) / "gguf-py")]
    from conversion.base import TextModel

    if pre_tokenizer:
        TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer
    keep_user_defined_pieces(TextModel)
    sys.argv = [str(Path(folder) / "convert_hf_to_gguf.py"), *converter_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
