"""Control tags: the grammar, validation messages, and text segmentation that never cuts a tag."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.text import tags
from server.text.segments import TextBuffer, split_segments


def test_the_tag_set_is_chatttss() -> None:
    assert {"[uv_break]", "[v_break]", "[lbreak]", "[laugh]"} <= tags.ALLOWED
    assert {f"[break_{k}]" for k in range(8)} <= tags.ALLOWED
    assert {f"[laugh_{k}]" for k in range(3)} <= tags.ALLOWED
    assert {f"[oral_{k}]" for k in range(10)} | {f"[speed_{k}]" for k in range(10)} <= tags.ALLOWED
    assert len(tags.ALLOWED) == 4 + 8 + 3 + 10 + 10
    assert not tags.ALLOWED & tags.RESERVED


@pytest.mark.parametrize("tag", sorted(tags.ALLOWED))
def test_every_allowed_tag_is_accepted(tag: str) -> None:
    assert tags.problem(f"你好{tag}world {tag}.") is None


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("wait [break_99] here", "[break_99]"),
        ("wait [break_8] here", "[break_8]"),
        ("a [foo] b", "[foo]"),
        ("see [1] and", "[1]"),
        ("[]", "[]"),
        ("[ laugh ]", "[ laugh ]"),
        ("[LAUGH]", "did you mean [laugh]"),
        ("hello [uv_break", "'[uv_break'"),
        ("hello [uv_break more [laugh]", "'[uv_break more '"),
        ("a ] b", "stray ']'"),
        ("[[laugh]]", "unclosed tag '['"),
        ("x[spk_emb]y", "[spk_emb]"),
        ("[Stts]hi[Ptts]", "[Stts]"),
    ],
)
def test_bad_tags_are_named(text: str, named: str) -> None:
    problem = tags.problem(text)
    assert problem is not None and named in problem


def test_an_open_tag_may_wait_for_more_text_only_when_it_can_still_become_one() -> None:
    assert tags.problem("hi [uv_", open_end=True) is None
    assert tags.problem("hi [", open_end=True) is None
    assert tags.problem("hi [laugh", open_end=True) is None
    problem = tags.problem("hi [fo", open_end=True)
    assert problem is not None and "'[fo'" in problem
    assert tags.problem("hi [uv_", open_end=False) is not None


def test_a_long_tag_name_is_echoed_shortened() -> None:
    problem = tags.problem("[" + "x" * 500 + "]")
    assert problem is not None and len(problem) < 400


_words = st.sampled_from(["hello", "世界", "a", "wonderful", "你好吗", "42", "x" * 30])
_tags = st.sampled_from(sorted(tags.ALLOWED))
_marks = st.sampled_from([" ", ", ", "。", "! ", "，", "", "\n"])
_pieces = st.lists(st.one_of(_words, _tags, _marks), min_size=1, max_size=60)


@given(_pieces, st.integers(min_value=12, max_value=60))
def test_segmentation_never_cuts_inside_a_tag(pieces: list[str], max_chars: int) -> None:
    text = "".join(pieces)
    segments = split_segments(text, max_chars=max_chars)
    for segment in segments:
        assert tags.problem(segment) is None, segment
    assert [m.group() for s in segments for m in tags.TAG.finditer(s)] == tags.TAG.findall(text)


def test_a_hard_cut_moves_to_the_tags_start() -> None:
    text = "x" * 18 + "[uv_break]" + "y" * 18
    assert split_segments(text, max_chars=20) == ["x" * 18, "[uv_break]" + "y" * 10, "y" * 8]


def test_a_tag_alone_after_the_last_sentence_end_joins_that_sentence() -> None:
    assert split_segments("Next one here. Wow![laugh]") == ["Next one here.", "Wow! [laugh]"]
    assert split_segments("好的。[laugh]") == ["好的。[laugh]"]


def test_a_stalled_buffer_keeps_an_unfinished_tag() -> None:
    buffer = TextBuffer()
    assert buffer.append("Hello there [uv_") == []
    assert buffer.take_clause() == ["Hello there"]
    assert buffer.pending == "[uv_"
    assert buffer.take_clause() == []
    assert buffer.append("break]again. ") == ["[uv_break]again."]
