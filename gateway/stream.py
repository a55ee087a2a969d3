"""Token ids in, text deltas out: special tokens dropped, UTF-8 kept whole, stop strings cut.

    text = TextStream(tokenizer, stop=["\\n\\n"])
    delta = text.push([331, 288])     # complete characters only; may be ""
    text.stopped                      # a stop string appeared: end the request, nothing more is emitted
    text.used                         # of the last push's ids, those up to the one that completed it
    tail = text.flush()               # end of stream

Special tokens (EOS, turn markers, padding) are control tokens, not text: they count as generated tokens
but never reach the text. What is held back between calls (a cut-off UTF-8 character, a possible start of a
stop string) is `IncrementalDetokenizer`'s business.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, stop)
        self._stops = any(stop)
        self.used = 0  # ids of the last `push` taken (all of them unless a stop string completed inside it)

    @property
    def stopped(self) -> bool:
        return self._detokenizer.stopped

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._detokenizer.text

    def push(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids` that is complete. With stop strings, ids go in one at a time, so `used` names the
        one that completed a stop string however the ids were chunked (speculative steps commit several)."""
        self.used = len(token_ids)
        if not self._stops:
            ids = [i for i in token_ids if not self._tokenizer.is_special(i)]
            return self._detokenizer.push(ids) if ids else ""
        out = []
        for n, i in enumerate(token_ids, 1):
            if not self._tokenizer.is_special(i):
                out.append(self._detokenizer.push([i]))
            if self._detokenizer.stopped:
                self.used = n
                break
        return "".join(out)

    def flush(self) -> str:
        return self._detokenizer.flush()
