"""The Gemma 4 demo world's tokenizer: a SentencePiece-style BPE like Gemma 4's own, trained offline.

Gemma 4's vocabulary is BPE over raw UTF-8 with spaces written as "▁", merges across words, byte fallback for what
the vocabulary lacks, and no word-level pre-split but newlines; llama.cpp's `gemma4` tokenizer does exactly that, and
the pinned converter reads such a `tokenizer.json` (LlamaHfVocab: BPE with byte_fallback). A fresh vocabulary built
that way converts and tokenizes the same in HF and llama.cpp with no Gemma file needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
TURN_START, TURN_END = "<|turn>", "<turn|>"
SPECIAL_TOKENS = [PAD, EOS, BOS, UNK, TURN_START, TURN_END]  # Gemma's own ids: pad 0, eos 1, bos 2, unk 3
BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]

# Gemma 4's turn format: the assistant is "model", each turn closed by <turn|> (llama.cpp ends generation on it).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<|turn>' + role + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<turn|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<turn|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}{%- endif %}"
)


def train_gemma4_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """Train the BPE on `texts`; a transformers fast tokenizer with Gemma 4's special tokens and turn template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(byte_fallback=True, unk_token=UNK, fuse_unk=True))
    lines = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")
    core.normalizer = normalizers.Replace(" ", "▁")
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + BYTE_TOKENS, min_frequency=2, show_progress=False
    )
    # Learnt word by word (each word with the "▁" before it), as Gemma's vocabulary mostly is: merged freely, a few
    # thousand templated dialogues make whole sentences single tokens. Used on lines, as llama.cpp's gemma4
    # pre-tokenizer splits: no merge joins two words, so both tokenize alike.
    core.pre_tokenizer = pre_tokenizers.Sequence([lines, pre_tokenizers.Split("▁", behavior="merged_with_next")])
    # the turn headers' role words start a line, where a word has no "▁": learnt as the template writes them
    roles = [f"{role}\n" for role in ("system", "user", "model")] * 1000
    core.train_from_iterator([*texts, *roles], trainer)
    core.pre_tokenizer = lines
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=TURN_END,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[EOS, TURN_START],
        chat_template=CHAT_TEMPLATE,
    )
