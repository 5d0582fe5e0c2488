"""An answer's text as its tokens arrive: only what is final is released (whole UTF-8 characters, nothing that may
still become a stop string), and where the first clause ends (what a voice bot speaks first)."""

from __future__ import annotations

import codecs

from spectune.runtime.chat import CLAUSE_END
from spectune.runtime.llama import LlamaModel


class TextStream:
    """Detokenizes as tokens arrive and releases only text that is final: an incomplete UTF-8 character, or a tail
    that could still grow into a stop string, is held back until the next tokens decide it. Control tokens (a chat
    template's <|im_start|>) are not text; a stop string counts only once `min_tokens` tokens are out (vLLM's rule)."""

    def __init__(self, model: LlamaModel, stop: list[str], min_tokens: int = 0) -> None:
        self.model, self.stop, self.min_tokens = model, [s for s in stop if s], min_tokens
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0
        self.token_ends: list[int] = []  # len(text) after each token
        self.stopped = False
        self.clause_seen = False
        self.clause_searched = 0  # text before this holds no clause end

    def first_clause_ended(self) -> bool:
        """True once: at the first call after the text holds a clause end (what a voice bot speaks first)."""
        if self.clause_seen:
            return False
        self.clause_seen = CLAUSE_END.search(self.text, max(0, self.clause_searched - 1)) is not None
        self.clause_searched = len(self.text)
        return self.clause_seen

    def add(self, tokens: list[int]) -> str:
        """The newly final text after `tokens`; sets `stopped` when a stop string appeared (it is cut off)."""
        for token in tokens:
            self.text += self.decoder.decode(self.model.piece(token, special=False))
            self.token_ends.append(len(self.text))
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._release(len(self.text))
        held = max((_stop_overlap(self.text, stop) for stop in self.stop), default=0)
        return self._release(len(self.text) - held)

    def _first_stop(self) -> int | None:
        """Where the first stop string starts in the text not yet searched, or None. Before min_tokens tokens none
        counts, and after them one counts only if it ends past their text (vLLM's rule)."""
        if len(self.token_ends) < self.min_tokens:
            return None
        floor = self.token_ends[self.min_tokens - 1] if self.min_tokens else 0
        search_from = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [self.text.find(s, max(search_from, floor - len(s) + 1)) for s in self.stop]
        return min((i for i in hits if i >= 0), default=None)

    def finish(self) -> str:
        """What was held back, once no more tokens come."""
        if not self.stopped:
            self.text += self.decoder.decode(b"", final=True)
        return self._release(len(self.text))

    def kept_tokens(self) -> int:
        """How many tokens the final text covers (a stop string cuts the tokens that reach into it)."""
        return sum(1 for end in self.token_ends if end <= len(self.text))

    def _release(self, upto: int) -> str:
        piece = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return piece


def _stop_overlap(text: str, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that `text` ends with: text that may still become the stop.
    Knuth-Morris-Pratt over the text's tail, so linear in the stop's length (a naive check is quadratic)."""
    pattern = stop[:-1]
    fail = [0] * len(pattern)  # fail[i]: longest proper prefix of pattern[: i + 1] that is also its suffix
    matched = 0
    for index in range(1, len(pattern)):
        while matched and pattern[index] != pattern[matched]:
            matched = fail[matched - 1]
        matched += pattern[index] == pattern[matched]
        fail[index] = matched
    matched = 0
    for char in text[-len(pattern) :] if pattern else "":
        while matched and (matched == len(pattern) or char != pattern[matched]):
            matched = fail[matched - 1]
        matched += matched < len(pattern) and char == pattern[matched]
    return matched
