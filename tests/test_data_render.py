"""Chat-template rendering and the assistant-only loss mask, checked token by token on real templates."""

from __future__ import annotations

import pytest

from spectune.data.render import render, render_all, truncate_on_turns
from spectune.errors import SpectuneError
from spectune.models.load import load_tokenizer

DIALOGUE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi, I need to move my appointment."},
    {"role": "assistant", "content": "Sure. What's the booking reference?"},
    {"role": "user", "content": "AB-12345."},
    {"role": "assistant", "content": "Done. See you on Friday at 3 pm."},
]

# A Llama-3-style template (header tokens, no generation markers): spans are found by prefix rendering.
LLAMA3_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>\n\n{{ m['content'] }}<|endoftext|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(micro_pair):
    return load_tokenizer(micro_pair / "target")


def trained_text(tokenizer, rendered) -> list[str]:
    """Decode each maximal run of trained tokens."""
    runs, current = [], []
    for token, trained in zip(rendered.input_ids, rendered.assistant_mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_mask_covers_exactly_the_assistant_turns_token_by_token(tokenizer):
    rendered = render(tokenizer, DIALOGUE)
    text = tokenizer.apply_chat_template(DIALOGUE, tokenize=False)
    assert tokenizer.decode(rendered.input_ids) == text
    # Every assistant turn of the dialogue is trained, with its end-of-turn marker, and nothing else.
    assert trained_text(tokenizer, rendered) == [
        "Sure. What's the booking reference?<|im_end|>",
        "Done. See you on Friday at 3 pm.<|im_end|>",
    ]
    # Token by token: the ChatML scaffolding, the system and user turns are never trained.
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for index, (token, trained) in enumerate(zip(rendered.input_ids, rendered.assistant_mask, strict=True)):
        if token == start_id:
            assert not trained, index
        if trained and token == end_id:
            assert tokenizer.decode(rendered.input_ids[index - 3 : index]).strip()  # closes an answer


def test_mask_with_another_template(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = LLAMA3_STYLE
    try:
        rendered = render(tokenizer, DIALOGUE)
        assert trained_text(tokenizer, rendered) == [
            "Sure. What's the booking reference?<|endoftext|>",
            "Done. See you on Friday at 3 pm.<|endoftext|>",
        ]
    finally:
        tokenizer.chat_template = original


def test_a_template_that_is_not_prefix_stable_is_refused(tokenizer):
    original = tokenizer.chat_template
    # Renders a turn count up front, so a shorter dialogue is not a prefix of a longer one.
    tokenizer.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        with pytest.raises(SpectuneError, match="not prefix-stable"):
            render(tokenizer, DIALOGUE)
    finally:
        tokenizer.chat_template = original


def test_truncation_cuts_on_turn_boundaries_and_counts(tokenizer):
    full = render(tokenizer, DIALOGUE)
    last_answer_end = max(i for i, m in enumerate(full.assistant_mask) if m) + 1
    kept, cut = truncate_on_turns(full, last_answer_end - 1)  # the second answer no longer fits
    assert cut == 1 and kept is not None
    assert trained_text(tokenizer, kept) == ["Sure. What's the booking reference?<|im_end|>"]
    assert tokenizer.decode(kept.input_ids).endswith("<|im_end|>")
    assert truncate_on_turns(full, last_answer_end)[1] == 0  # a trailing newline is no turn
    dropped, cut_all = truncate_on_turns(full, 5)
    assert dropped is None and cut_all == 2
    rows, stats = render_all(tokenizer, [DIALOGUE, DIALOGUE[:3]], max_seq_length=last_answer_end - 1)
    assert stats.kept == 2 and stats.truncated == 1 and stats.turns_cut == 1
    rows, stats = render_all(tokenizer, [DIALOGUE], max_seq_length=5)
    assert rows == [] and stats.dropped == {"first assistant turn longer than max tokens": 1}


def test_no_chat_template_is_a_clear_error(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with pytest.raises(SpectuneError, match="no chat template"):
            render(tokenizer, DIALOGUE)
    finally:
        tokenizer.chat_template = original
