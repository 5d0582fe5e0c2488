"""Render dialogues with a tokenizer's chat template and mark the tokens the model is trained on.

Only assistant turns are trained (their text and the end-of-turn marker), every assistant turn of a
multi-turn dialogue in one sequence. Spans are found by rendering growing prefixes of the dialogue, so any
prefix-stable chat template works (ChatML, Llama 3, Gemma, Mistral ...), not only ones with generation markers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spectune.errors import SpectuneError


@dataclass
class Rendered:
    input_ids: list[int]
    assistant_mask: list[int]  # 1 where the token is trained

    @property
    def trained_tokens(self) -> int:
        return sum(self.assistant_mask)


@dataclass
class RenderStats:
    dialogues: int = 0
    kept: int = 0
    truncated: int = 0  # dialogues cut on a turn boundary
    turns_cut: int = 0  # assistant turns lost to truncation
    dropped: Counter[str] = field(default_factory=Counter)


def _template(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character span of each assistant turn (content and end-of-turn marker)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise SpectuneError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: "
            "give one with --chat-template FILE"
        )
    text = _template(tokenizer, messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _template(tokenizer, messages[:index], True)
        upto = _template(tokenizer, messages[: index + 1], False).rstrip("\n")
        start, end = len(prompt), len(upto)
        if not (text.startswith(upto) and upto.startswith(prompt) and message["content"].strip() in upto[start:]):
            raise SpectuneError(
                "the chat template is not prefix-stable (rendering the first turns of a dialogue is not a "
                "prefix of rendering all of it), so assistant turns cannot be located; give a template that "
                "is, with --chat-template FILE"
            )
        spans.append((start, end))
    return text, spans


def render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> Rendered:
    """Tokenize one dialogue; mask = 1 on tokens that start inside an assistant span."""
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    span_index = 0
    for start, _end in encoded["offset_mapping"]:
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        inside = span_index < len(spans) and spans[span_index][0] <= start < spans[span_index][1]
        mask.append(int(inside))
    return Rendered(list(encoded["input_ids"]), mask)


def truncate_on_turns(rendered: Rendered, max_seq_length: int) -> tuple[Rendered | None, int]:
    """Cut after the last assistant turn that fits in `max_seq_length`; returns (kept or None, turns cut)."""
    if len(rendered.input_ids) <= max_seq_length:
        return rendered, 0
    mask = rendered.assistant_mask
    # An assistant turn ends where the mask falls from 1 to 0 (or at the end of the sequence).
    ends = [i + 1 for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
    fitting = [end for end in ends if end <= max_seq_length]
    if not fitting:
        return None, len(ends)
    cut = fitting[-1]
    return Rendered(rendered.input_ids[:cut], mask[:cut]), len(ends) - len(fitting)


def render_all(
    tokenizer: Any, dialogues: Sequence[Sequence[dict[str, str]]], max_seq_length: int | None = None
) -> tuple[list[Rendered], RenderStats]:
    """Render many dialogues, truncating on turn boundaries; every cut and drop is counted."""
    stats = RenderStats(dialogues=len(dialogues))
    kept = []
    for messages in dialogues:
        rendered: Rendered | None = render(tokenizer, messages)
        if max_seq_length is not None:
            full_length = len(rendered.input_ids)
            rendered, cut = truncate_on_turns(rendered, max_seq_length)
            stats.turns_cut += cut
            if rendered is None:
                stats.dropped["first assistant turn longer than max tokens"] += 1
                continue
            stats.truncated += int(len(rendered.input_ids) < full_length)
        if rendered.trained_tokens == 0:
            stats.dropped["no trainable tokens"] += 1
            continue
        kept.append(rendered)
    stats.kept = len(kept)
    return kept, stats
