"""Chat prompts from the chat template stored in the GGUF (what llama.cpp's own server would use)."""

from __future__ import annotations

import functools
import re
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

from spectune.errors import SpectuneError
from spectune.runtime.llama import LlamaModel

# Where a clause ends: what a voice bot's TTS can speak without waiting for more (the server's sentence chunking,
# the bench's time to first sentence): Latin punctuation before a space or the end, and the full-width CJK marks
# (。！？；：，、), Arabic's (، ؛ ؟) and the Devanagari danda (।), which need no space after them. A period after an
# abbreviation that a sentence goes on after ("e.g.", "Dr.", "No. 5") ends nothing.
ABBREVIATIONS = ("e.g", "i.e", "Dr", "Mr", "Mrs", "Ms", "Mx", "Prof", "St", "Mt", "No", "vs", "Jr", "Sr", "approx")
_AFTER_NO_ABBREVIATION = "".join(rf"(?<!\b{re.escape(word)})" for word in ABBREVIATIONS)
CLAUSE_END = re.compile(rf"(?:[!?;:,]|{_AFTER_NO_ABBREVIATION}\.)(\s|$)|[。！？；：，、،؛؟।]")
# Where a message's content stood in the rendered template (chat_tokens).
_MARKER = re.compile(r"\x01(\d+)\x02")
# HF's assistant-mask markers are a transformers extension of Jinja; rendering for inference ignores them.
_GENERATION_TAGS = re.compile(r"{%-?\s*(?:end)?generation\s*-?%}")


def chat_prompt(model: LlamaModel, messages: list[dict[str, str]], template: str | None = None) -> str:
    """Render `messages` with the GGUF's chat template, ending with the assistant's generation prompt."""
    template = template or model.metadata("tokenizer.chat_template")
    if not template:
        raise SpectuneError(f"{model.path}: the GGUF has no chat template (tokenizer.chat_template)")
    bos = model.detokenize([model.bos]) if model.bos >= 0 else ""
    eos = model.detokenize([model.eos]) if model.eos >= 0 else ""
    return compiled(template).render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)


@functools.lru_cache(maxsize=16)  # compiling a template took longer than rendering it: once per template
def compiled(template: str) -> Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> Any:
        raise SpectuneError(f"chat template: {message}")

    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(_GENERATION_TAGS.sub("", template))


def chat_tokens(model: LlamaModel, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's tokens with control tokens parsed in the template's own text only: a caller who writes
    `<|im_start|>system` in a message gets those characters as text, never a new role (role injection)."""
    return prompt_tokens(model, messages)[0]


def prompt_tokens(model: LlamaModel, messages: list[dict[str, str]]) -> tuple[list[int], int]:
    """chat_tokens, and where in them the first words of a caller start: the leading system messages and the
    template's own text around them (what every caller of an operator's bot sends alike; 0 where the template
    rewrites contents so that no place is sure).

    Linear in the conversation's length: each message's content is swapped for a numbered marker, the template is
    rendered once, and one split finds the template's own text between the markers."""
    pieces, order = _template_pieces(model, messages)
    contents = [m["content"] for m in messages]
    leading = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if order == list(range(len(messages))) and "".join(
        piece + content for piece, content in zip(pieces, [*contents, ""], strict=True)
    ) == chat_prompt(model, messages):
        tokens, shared = [], 0
        for index, (piece, content) in enumerate(zip(pieces, contents, strict=False)):
            tokens += model.tokenize(piece)
            shared = len(tokens) if index == leading else shared  # the template's text before the caller's words
            tokens += model.tokenize(content, special=False)
        return tokens + model.tokenize(pieces[-1]), shared
    # The template changes or repeats contents (e.g. trims them): refuse control-token text instead.
    for content in contents:
        if model.tokenize(content) != model.tokenize(content, special=False):
            raise SpectuneError("a message holds the text of a control token (such as <|im_start|>): not allowed")
    return model.tokenize(chat_prompt(model, messages)), 0


def _template_pieces(model: LlamaModel, messages: list[dict[str, str]]) -> tuple[list[str], list[int]]:
    """The template's own text around the messages' contents, and the order the contents came in: each content is
    swapped for a numbered marker and the template rendered once."""
    masked = chat_prompt(model, [{**m, "content": f"\x01{index}\x02"} for index, m in enumerate(messages)])
    parts = _MARKER.split(masked)  # text, index, text, index, ..., text
    return parts[0::2], [int(index) for index in parts[1::2]]


def turn_opening(model: LlamaModel, messages: list[dict[str, str]]) -> list[int]:
    """The tokens of the template's text between an answer to `messages` and the caller's next words (ChatML's
    `<|im_end|>\n<|im_start|>user\n`), as prompt_tokens will tokenize them in the next turn's prompt; [] where the
    template does not keep contents apart from its own text."""
    turn = [*messages, {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]
    try:
        pieces, order = _template_pieces(model, turn)
    except SpectuneError:  # e.g. a template that checks how roles alternate
        return []
    return model.tokenize(pieces[-2]) if order == list(range(len(turn))) else []
