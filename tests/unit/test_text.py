from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.text.segments import clean, has_speakable, split_complete, split_segments


def test_chinese_and_english_sentences() -> None:
    text = "你好，欢迎使用语音服务。今天天气很好！This is a test. Does it work? 最后一句话。"
    assert split_segments(text) == [
        "你好，欢迎使用语音服务。",
        "今天天气很好！",
        "This is a test.",
        "Does it work?",
        "最后一句话。",
    ]


def test_decimals_abbreviations_and_quotes_stay_together() -> None:
    assert split_segments("Pi is 3.14 exactly. He said “好的。”然后走了。") == [
        "Pi is 3.14 exactly.",
        "He said “好的。”",
        "然后走了。",
    ]


def test_line_breaks_end_sentences_and_blanks_collapse() -> None:
    assert split_segments("first line\nsecond   line") == ["first line", "second line"]
    assert clean("  a \t b  ") == "a b"


def test_long_sentence_is_cut_at_clauses_within_the_limit() -> None:
    text = "，".join(["这是一个很长的句子的一部分"] * 20) + "。"
    pieces = split_segments(text, max_chars=40)
    assert all(len(p) <= 40 for p in pieces)
    assert "".join(pieces) == text


def test_unbroken_text_is_cut_hard() -> None:
    pieces = split_segments("a" * 250, max_chars=100)
    assert [len(p) for p in pieces] == [100, 100, 50]


def test_tiny_pieces_join_a_neighbour() -> None:
    assert split_segments("OK. Then we go on with the plan.") == ["OK. Then we go on with the plan."]


def test_split_complete_keeps_the_unfinished_rest() -> None:
    assert split_complete("One. Two! Thr") == (["One.", "Two!"], " Thr")
    assert split_complete("no end yet") == ([], "no end yet")


def test_has_speakable() -> None:
    assert has_speakable("a。") and has_speakable("三") and not has_speakable("……！ ")
    assert has_speakable("Café") and has_speakable("١٢٣") and has_speakable("Привет, Bob.")
    for other_script in ("Привет мир.", "こんにちは。", "안녕하세요", "Γειά σου", "مرحبا", "😀🎉", "ⅷ"):
        assert not has_speakable(other_script), other_script
    # Control tags are not words (issue #25): tags alone give the model nothing to say.
    assert not has_speakable("[laugh][laugh]") and not has_speakable("[uv_break]，[break_3]。")
    assert has_speakable("[laugh] ha") and has_speakable("[uv_break]你")


@given(st.text(alphabet=st.sampled_from("ab 。.!,，你好\n"), max_size=400), st.integers(10, 80))
def test_segments_bounded_and_lose_no_speakable_characters(text: str, max_chars: int) -> None:
    pieces = split_segments(text, max_chars=max_chars)
    assert all(0 < len(p) <= max_chars for p in pieces)
    keep = lambda s: "".join(ch for ch in s if ch.isalnum())  # noqa: E731
    assert keep("".join(pieces)) == keep(text)


def test_fit_tokens_cuts_at_the_clause_end_then_spaces_and_never_inside_a_word() -> None:
    from server.text.segments import TooManyTokens, fit_tokens

    def count(text: str) -> int:
        return len(text)

    text = "alpha beta gamma, delta epsilon zeta eta theta"
    pieces = fit_tokens(text, count, 20)
    assert " ".join(pieces) == text and max(map(len, pieces)) <= 20
    assert pieces[0] == "alpha beta gamma,"  # the clause mark first
    assert fit_tokens("short", count, 20) == ["short"]
    with pytest.raises(TooManyTokens) as refused:
        fit_tokens("go " + "9" * 30, count, 20)
    assert (refused.value.piece, refused.value.tokens) == ("9" * 30, 30)
    # Text already taken (mid-stream) is cut hard instead, never inside a tag.
    hard = fit_tokens("9" * 30 + "[laugh]" + "9" * 10, count, 20, hard=True)
    assert "".join(hard) == "9" * 30 + "[laugh]" + "9" * 10 and max(map(len, hard)) <= 20
    assert all(p.count("[") == p.count("]") for p in hard)


def test_a_flush_is_ready_at_a_sentence_end_or_a_clause_of_speech() -> None:
    from server.text.segments import TextBuffer

    def ready(text: str) -> bool:
        buffer = TextBuffer()
        buffer.append(text)
        return buffer.flush_ready()

    assert ready("Yes.") and ready("a longer clause of words") and ready("我们今天去公园玩") and ready("123")
    assert not ready("a") and not ready("the cat") and not ready("我们今天去公园") and not ready("12")
