"""Chat prompts from the chat template stored in the GGUF (what llama.cpp's own server would use)."""

from __future__ import annotations

import re
from typing import Any

from spectune.errors import SpectuneError
from spectune.runtime.llama import LlamaModel

# HF's assistant-mask markers are a transformers extension of Jinja; rendering for inference ignores them.
_GENERATION_TAGS = re.compile(r"{%-?\s*(?:end)?generation\s*-?%}")


def chat_prompt(model: LlamaModel, messages: list[dict[str, str]], template: str | None = None) -> str:
    """Render `messages` with the GGUF's chat template, ending with the assistant's generation prompt."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = template or model.metadata("tokenizer.chat_template")
    if not template:
        raise SpectuneError(f"{model.path}: the GGUF has no chat template (tokenizer.chat_template)")
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> Any:
        raise SpectuneError(f"chat template: {message}")

    environment.globals["raise_exception"] = raise_exception
    bos = model.detokenize([model.bos]) if model.bos >= 0 else ""
    eos = model.detokenize([model.eos]) if model.eos >= 0 else ""
    return environment.from_string(_GENERATION_TAGS.sub("", template)).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )
