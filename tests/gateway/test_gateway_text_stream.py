"""`TextStream`: the ids sent with a stream's text end at the token that completed the stop string it stops at,
however the ids were chunked, also where a longer stop string starting earlier kept the stream waiting."""

from __future__ import annotations

import pytest

from gateway.stream import TextStream


def _run(tokenizer, chunks, stops):
    """As the gateway's servicer reads it: a chunk's text and ids, the last chunk's after the flush too."""
    text = TextStream(tokenizer, stops)
    out, ids = "", []
    for n, chunk in enumerate(chunks, 1):
        out += text.push(chunk)
        if text.stopped or n == len(chunks):
            out += text.flush()
        ids += text.ids
        if text.stopped:
            break
    assert text.sent == len(ids)
    return out, ids, text.stopped


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_a_shorter_stop_held_for_a_longer_one_ends_the_ids_where_it_completed(tiny_tokenizer, one_at_a_time):
    """QA: stops "1\\nX" and "\\n" on " return 1\\n y": the text was cut right, but the ids (and completion_tokens)
    ran a token past the "\\n", the one read to rule "1\\nX" out."""
    head, newline, tail = (tiny_tokenizer.encode(t) for t in (" return 1", "\n", " y = 2"))
    ids = head + newline + tail
    chunks = [[i] for i in ids] if one_at_a_time else [ids[:3], ids[3:]]
    text, sent, stopped = _run(tiny_tokenizer, chunks, ["1\nX", "\n"])
    assert stopped and text == " return 1" and sent == head + newline


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_the_longer_stop_starting_earlier_ends_the_ids_where_it_completed(tiny_tokenizer, one_at_a_time):
    head, newline, x, tail = (tiny_tokenizer.encode(t) for t in (" return 1", "\n", "X", " y"))
    ids = head + newline + x + tail
    chunks = [[i] for i in ids] if one_at_a_time else [ids]
    text, sent, stopped = _run(tiny_tokenizer, chunks, ["1\nX", "\n"])
    assert stopped and text == " return " and sent == head + newline + x


def test_a_held_stop_at_the_streams_end_ends_the_ids_where_it_completed(tiny_tokenizer):
    """The length limit comes while "1\\nX" may still complete: the flush settles on "\\n"."""
    head, newline = tiny_tokenizer.encode(" return 1"), tiny_tokenizer.encode("\n")
    text, sent, stopped = _run(tiny_tokenizer, [head, newline], ["1\nX", "\n"])
    assert stopped and text == " return 1" and sent == head + newline


def test_without_a_stop_every_id_is_sent(tiny_tokenizer):
    ids = tiny_tokenizer.encode(" return 1\n y")
    assert _run(tiny_tokenizer, [ids[:2], ids[2:]], []) == (" return 1\n y", ids, False)
    assert _run(tiny_tokenizer, [ids[:2], ids[2:]], ["never"]) == (" return 1\n y", ids, False)
