"""`IncrementalDetokenizer` against whole-sequence decode, for every split point of the id stream."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_corpus import PROSE

from specdec.tokenizer import IncrementalDetokenizer

MULTIBYTE = "naïve 你好, мир 🙂👍🏽 done"


def _stream(tokenizer, chunks, stop_strings=()):
    detok = IncrementalDetokenizer(tokenizer, stop_strings)
    pieces = [detok.push(chunk) for chunk in chunks]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return detok, pieces


def test_every_two_way_split_equals_whole_decode(tiny_code):
    for text in [MULTIBYTE, *PROSE[3:8]]:
        ids = tiny_code.encode(text)
        for cut in range(len(ids) + 1):
            detok, _ = _stream(tiny_code, [ids[:cut], ids[cut:]])
            assert detok.text == tiny_code.decode(ids) == text


def test_one_token_at_a_time_never_emits_partial_characters(tiny_code):
    ids = tiny_code.encode(MULTIBYTE)
    detok, pieces = _stream(tiny_code, [[i] for i in ids])
    assert "\ufffd" not in "".join(pieces)
    assert detok.text == MULTIBYTE
    assert pieces[ids.index(231)] == ""  # the first byte of 你 alone gives no text yet


def test_cut_off_character_becomes_replacement_at_flush(tiny_code):
    ids = tiny_code.encode("ok 你")[:-1]
    detok, pieces = _stream(tiny_code, [[i] for i in ids])
    assert detok.text == tiny_code.decode(ids) == "ok \ufffd"


def test_stop_string_spanning_tokens_at_every_split(tiny_code):
    text = "first line\n\nsecond 你好 END third"
    ids = tiny_code.encode(text)
    for stop, expected in [("\n\n", "first line"), ("好 EN", "first line\n\nsecond 你"), ("third!", text)]:
        for cut in range(len(ids) + 1):
            detok, _ = _stream(tiny_code, [ids[:cut], ids[cut:]], [stop])
            assert detok.text == expected
            assert detok.stopped == (stop in text)


def test_text_that_may_start_a_stop_string_is_held_back(tiny_code):
    detok = IncrementalDetokenizer(tiny_code, ["<END>"])
    assert detok.push(tiny_code.encode("value <E")) == "value "
    assert detok.push(tiny_code.encode("Q")) == "<EQ"  # no longer a possible stop
    assert detok.push(tiny_code.encode(" <EN")) == " "
    assert detok.push(tiny_code.encode("D> rest")) == ""
    assert detok.stopped and detok.text == "value <EQ "
    assert detok.push(tiny_code.encode("more")) == "" and detok.flush() == ""


def test_earliest_of_several_stop_strings_wins(tiny_code):
    ids = tiny_code.encode("abc xyz def")
    detok, _ = _stream(tiny_code, [[i] for i in ids], ["def", "c xy", "xyz"])
    assert detok.text == "ab"


def test_a_stop_starting_earlier_that_completes_later_wins(tiny_code):
    """Stops "b" and "<b<": after "<b" the "b" has matched, but "<b<" may still match from 0 (earlier); the
    text waits for the next push instead of cutting at "b", so every split gives the whole decode's cut."""
    for rest, expected in (("<", ""), ("x", "<")):
        chunks = [tiny_code.encode("<b"), tiny_code.encode(rest)]
        detok, pieces = _stream(tiny_code, chunks, ["b", "<b<"])
        assert pieces[0] == "" and detok.text == expected and detok.stopped
    detok, _ = _stream(tiny_code, [tiny_code.encode("<b")], ["b", "<b<"])  # the stream ends: "b" it is
    assert detok.text == "<" and detok.stopped


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab \n你🙂é<>")), max_size=30),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    stops=st.lists(st.text(alphabet=st.sampled_from(list("ab \n你<>")), min_size=1, max_size=3), max_size=2),
)
def test_any_chunking_equals_decode_cut_at_first_stop(tiny_code, text, cuts, stops):
    ids = tiny_code.encode(text)
    bounds = sorted({0, len(ids), *(c for c in cuts if c <= len(ids))})
    chunks = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    detok, _ = _stream(tiny_code, chunks, stops)
    whole = tiny_code.decode(ids)
    first = min((whole.find(s) for s in stops if s in whole), default=len(whole))
    assert detok.text == whole[:first]
    assert detok.stopped == any(s in whole for s in stops)


def test_a_cut_off_character_at_the_end_completes_no_stop_string(tiny_code):
    """The U+FFFD of bytes cut off at the stream's end is no character of the text: a stop string ending in one
    (copied from an earlier output) neither cuts the text nor ends the request (QA: the text was cut while the
    request reported its length limit). One held back till the end still cuts."""
    ids = tiny_code.encode("ok 你")[:-1]
    for stops in (["\ufffd"], [" \ufffd"], ["ok \ufffd"]):
        detok, pieces = _stream(tiny_code, [[i] for i in ids], stops)
        assert detok.text == "ok \ufffd" and not detok.stopped, stops
    detok, _ = _stream(tiny_code, [tiny_code.encode("a<b")], ["b", "<b<", "\ufffd"])
    assert detok.text == "a<" and detok.stopped
