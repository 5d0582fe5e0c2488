"""What the decoder streams: only final text. A stop string split across steps is never streamed in part, and a
character split across tokens is never streamed as U+FFFD; the streamed text equals the non-streamed one."""

from __future__ import annotations

import numpy as np

from spectune.runtime.decode import DecodeSettings
from spectune.runtime.sampling import probabilities
from spectune.runtime.text import TextStream


class Pieces:
    """A stand-in vocabulary: token i is the bytes pieces[i]."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def piece(self, token: int, special: bool = True) -> bytes:
        return self.pieces[token]


def streamed(pieces: list[bytes], steps: list[list[int]], stop: list[str]) -> tuple[list[str], TextStream]:
    stream = TextStream(Pieces(pieces), stop)
    out = []
    for tokens in steps:
        out.append(stream.add(tokens))
        if stream.stopped:
            break
    out.append(stream.finish())
    return out, stream


def test_a_stop_string_split_across_steps_is_never_streamed_in_part():
    pieces = [b"the", b" this", b" ear", b"ly", b" bird"]
    out, stream = streamed(pieces, [[0, 1], [2], [3, 4]], stop=[" early"])
    assert "".join(out) == "the this" == stream.text
    assert all(" ear" not in piece for piece in out)
    assert stream.stopped and stream.kept_tokens() == 2


def test_text_that_only_looks_like_a_stop_prefix_is_released_once_decided():
    out, stream = streamed([b"the", b" ea", b"gle"], [[0, 1], [2]], stop=[" early"])
    assert out[0] == "the" and "".join(out) == "the eagle" and not stream.stopped


def test_a_character_split_across_tokens_is_streamed_whole():
    pieces = ["気".encode(), "あ".encode()[:1], "あ".encode()[1:]]
    out, stream = streamed(pieces, [[0, 1], [2]], stop=[])
    assert out == ["気", "あ", ""] and "\ufffd" not in "".join(out)
    assert stream.text == "気あ"


def test_an_unfinished_character_at_the_end_becomes_one_replacement_character():
    out, stream = streamed([b"ok", "あ".encode()[:2]], [[0, 1]], stop=[])
    assert "".join(out) == "ok\ufffd" == stream.text


def test_a_vanishing_temperature_is_greedy_not_nan():
    logits = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    probs = probabilities(logits, DecodeSettings(temperature=1e-308))
    assert np.array_equal(probs, [0.0, 1.0, 0.0])
