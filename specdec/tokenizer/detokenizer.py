"""`IncrementalDetokenizer`: token ids in, complete UTF-8 text out, for streaming responses.

Two things are held back between calls: bytes that end in the middle of a multi-byte UTF-8 character (in the
incremental UTF-8 decoder), and text that could still become the start of a stop string (`_held`). Whatever
the split of ids into `push` calls, the concatenation of everything returned equals
`decode(all ids)` cut just before the first occurrence of any stop string.

Example, stop string "\\n\\n": push("a\\n") -> "a" (the "\\n" may start a stop), push("\\nb") -> "" and
`stopped` is True; `text` == "a".
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from specdec.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet emitted: a suffix that may begin a stop string
        self.stopped = False  # a stop string matched; nothing more is emitted
        self.text = ""  # everything emitted so far
        # where (in the whole text) the earliest complete stop string starts, once one has: the stop, or one held
        # while a longer stop string starting earlier may still complete (then the stream stops at one of the two)
        self.match_at: int | None = None

    def push(self, ids: Sequence[int]) -> str:
        """New complete text since the last call (maybe ""); after a stop match, always ""."""
        if self.stopped:
            return ""
        return self._emit(self._utf8.decode(self._tokenizer.decode_bytes(ids)), final=False)

    def flush(self) -> str:
        """End of stream: the rest of the text, cut before a stop string it holds (one that a longer stop string
        starting earlier kept pending), then a cut-off character as U+FFFD. That U+FFFD stands for bytes that never
        became a character, so it completes no stop string: a stop string ending in U+FFFD (copied from an earlier
        output) once cut the text at the stream's end while the request reported its length limit (QA)."""
        if self.stopped:
            return ""
        tail = self._utf8.decode(b"", final=True)
        emitted = self._emit("", final=True)
        if not self.stopped:
            self.text += tail
            emitted += tail
        return emitted

    def _emit(self, new_text: str, final: bool) -> str:
        window = self._held + new_text
        stop_at = _first_stop(window, self._stop_strings)
        self.match_at = None if stop_at is None else len(self.text) + stop_at
        pending = None if stop_at is None or final else _pending_start(window, self._stop_strings, stop_at)
        if pending is not None:  # a stop string starting earlier may still complete: the next text decides
            emitted, self._held = window[:pending], window[pending:]
        elif stop_at is not None:
            self.stopped = True
            emitted, self._held = window[:stop_at], ""
        else:
            keep = 0 if final else _longest_stop_prefix_suffix(window, self._stop_strings)
            emitted, self._held = window[: len(window) - keep], window[len(window) - keep :]
        self.text += emitted
        return emitted


def _first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    """Start of the earliest stop string occurrence in `text`, or None."""
    starts = [start for start in (text.find(stop) for stop in stop_strings) if start >= 0]
    return min(starts) if starts else None


def _pending_start(text: str, stop_strings: tuple[str, ...], before: int) -> int | None:
    """The earliest position before `before` from which `text` is a proper prefix of a stop string (one that can
    still complete with more text), or None. Example: stops "b" and "<b<", text "<b": "b" matched at 1, but
    "<b<" may still match at 0, which would cut earlier."""
    earliest = None
    for stop in stop_strings:
        for start in range(max(0, len(text) - len(stop) + 1), before if earliest is None else min(before, earliest)):
            if stop.startswith(text[start:]):
                earliest = start
                break
    return earliest


def _longest_stop_prefix_suffix(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
