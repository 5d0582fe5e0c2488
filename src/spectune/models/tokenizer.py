"""The demo world's tokenizer: a byte-level BPE with GPT-2's pre-tokenizer, trained offline.

Why this path: llama.cpp implements GPT-2's byte-level pre-tokenizer ("gpt-2") exactly, so a fresh vocabulary
tokenizes the same in HF and llama.cpp. The converter only refuses it because it recognises pre-tokenizers by a
hash of known vocabularies; `tokenizer_config.json` therefore declares `spectune_pre_tokenizer: gpt-2`, which the
export stage passes to the converter. `tests/test_models.py` proves HF == llama.cpp on thousands of strings.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

BOS = "<|endoftext|>"
CHAT_START = "<|im_start|>"
CHAT_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, CHAT_START, CHAT_END]
PRE_TOKENIZER = "gpt-2"

# ChatML, with HF's generation markers around what the assistant says (TRL's assistant-only loss uses them).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """Train the BPE on `texts` and wrap it as a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=CHAT_END,
        pad_token=BOS,
        chat_template=CHAT_TEMPLATE,
        add_bos_token=False,
        add_eos_token=False,
    )


def save_tokenizer(tokenizer: Any, out_dir: str | Path) -> None:
    """Save, declaring the pre-tokenizer for llama.cpp's converter."""
    import json

    out_dir = Path(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["spectune_pre_tokenizer"] = PRE_TOKENIZER
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
