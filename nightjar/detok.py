"""Incremental detokenization with stop strings that may span token boundaries."""
from __future__ import annotations


class IncrementalText:
    """Turns token deltas into text deltas; holds back text that might start a stop string and an
    incomplete UTF-8 sequence at the end (dropped if the output ends there)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0                 # characters already emitted
        self.text = ""
        self.stopped = False

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that may be shown now."""
        self.ids.extend(new_ids)
        full = self.tok.decode(self.ids) if self.tok else ""
        if full.endswith("\ufffd"):
            # an incomplete UTF-8 sequence (the decoder writes one U+FFFD for it): wait for more bytes while
            # streaming; at the end the answer was cut inside a character, so drop it. (A literal U+FFFD
            # as the very last character of an answer is dropped too.)
            full = full[: len(full) - 1]
        cut = self._find_stop(full)
        if cut is not None:
            full, self.stopped, final = full[:cut], True, True
        self.text = full
        hold = 0 if final else self._holdback(full)
        delta = full[self.sent: len(full) - hold]
        self.sent += len(delta)
        return delta

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    best = max(best, k)
                    break
        return best
