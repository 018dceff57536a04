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
        self.whole = ""               # the text of ids[:read], which ends on a whole character
        self.prefix = self.read = 0   # the next decode starts at ids[prefix] (read - prefix tokens of context)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that may be shown now."""
        self.ids.extend(new_ids)
        full = self._decode()
        cut = self._find_stop(full)
        if cut is not None:
            full, self.stopped, final = full[:cut], True, True
        self.text = full
        hold = 0 if final else self._holdback(full)
        delta = full[self.sent: len(full) - hold]
        self.sent += len(delta)
        return delta

    def _decode(self) -> str:
        """The text of every token so far, as one decode of them all gives it, less a trailing U+FFFD: an
        incomplete UTF-8 sequence (the decoder writes one U+FFFD for it) waits for more bytes while streaming;
        at the end the answer was cut inside a character, so it is dropped (a literal U+FFFD as the very last
        character of an answer is dropped too). Decodes only the tokens since the last whole character, with
        the tokens before them as context (a decoder may treat the first token of a decode differently), so a
        step costs the same at token 10 and 10,000."""
        if not self.tok:
            return ""
        head = self.tok.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        window = self.tok.decode(self.ids[self.prefix:])
        if not window.startswith(head):       # a decoder that rewrites across tokens: start over from token 0
            head, window, self.whole, self.prefix, self.read = "", self.tok.decode(self.ids), "", 0, 0
        new = window[len(head):]
        if new.endswith("\ufffd"):
            return self.whole + new[:-1]
        self.whole += new
        self.prefix, self.read = self.read, len(self.ids)
        return self.whole

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
