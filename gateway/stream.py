"""Token ids in, text deltas out: special tokens dropped, UTF-8 kept whole, stop strings cut.

    text = TextStream(tokenizer, stop=["\\n\\n"])
    delta = text.push([331, 288])     # complete characters only; may be ""
    text.ids                          # the ids to send with that text (held back ones may come later)
    text.stopped                      # a stop string appeared: end the request, nothing more is emitted
    tail = text.flush()               # end of stream (text.ids: what it released more)
    text.sent                         # ids released in all: those up to the one that completed the stop string

Special tokens (EOS, turn markers, padding) are control tokens, not text: they count as generated tokens
but never reach the text. What is held back between calls (a cut-off UTF-8 character, a possible start of a
stop string) is `IncrementalDetokenizer`'s business; the ids after one that completed a stop string while a longer
one starting earlier may still complete are held here: the stream stops at one of the two, and the ids end at the
token that completed the one it stops at (QA: with stops "1\\nX" and "\\n" the ids ran a token past the "\\n").
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, stop)
        self._stops = any(stop)
        self.ids: list[int] = []  # the ids the last `push` (and a `flush` after it) released
        self.sent = 0  # ids released in all
        self._match_at: int | None = None  # where the complete stop string the held ids wait behind starts
        self._held: list[int] = []  # ids after the one that completed it, until it is known which stop ends the text

    @property
    def stopped(self) -> bool:
        return self._detokenizer.stopped

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._detokenizer.text

    def push(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids` that is complete; `ids` the ids released with it. With stop strings, ids go in one
        at a time, so the ids end at the one that completed the stop string however they were chunked
        (speculative steps commit several)."""
        self.ids = []
        if not self._stops:
            self._release(list(token_ids))
            ids = [i for i in token_ids if not self._tokenizer.is_special(i)]
            return self._detokenizer.push(ids) if ids else ""
        out = []
        for i in token_ids:
            if not self._tokenizer.is_special(i):
                out.append(self._detokenizer.push([i]))
            if self._settle(i):
                break
        return "".join(out)

    def flush(self) -> str:
        tail = self._detokenizer.flush()
        if self._detokenizer.stopped:
            self._settle(None)
        else:
            self._release(self._held)
            self._held = []
        return tail

    def _settle(self, i: int | None) -> bool:
        """Release or hold id `i` (None: the stream's end) by what the text after it says; -> stopped."""
        d = self._detokenizer
        if d.stopped:  # it completed the stop string, or a held one is the stop: its ids end where it completed
            if d.match_at != self._match_at and i is not None:
                self._release([*self._held, i])
            self._held = []
            return True
        now = [i] if i is not None else []
        if d.match_at is None:
            self._release(now)
        elif self._match_at is None or d.match_at < self._match_at:  # (a longer one, starting earlier, completed)
            self._match_at = d.match_at
            self._release([*self._held, *now])
            self._held = []
        else:
            self._held += now
        return False

    def _release(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.sent += len(ids)
