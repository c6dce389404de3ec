from __future__ import annotations

import pytest

pytest.importorskip("cn2an")

from server.text.normalize import speakable


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("I have 123 apples.", "I have one hundred and twenty three apples."),
        ("It costs $1,200 & tax.", "It costs one thousand two hundred dollars and tax."),
        (
            "$12.50, $1, $0.99 or $1.999.",
            "twelve dollars fifty cents, one dollar, ninety nine cents or one point nine nine nine dollars.",
        ),
        (
            "In 2026, 50% were -3.5 points up.",
            "In twenty twenty six, fifty percent were minus three point five points up.",
        ),
        ("今天是2026年11月29日，占比50%。", "今天是二零二六年十一月二十九日，占比百分之五十。"),
        ("温度是-3.5度，A+B。", "温度是负三点五度，A加B。"),
        ("No numbers here.", "No numbers here."),
    ],
)
def test_numbers_and_symbols_are_spelled_out(text: str, spoken: str) -> None:
    assert speakable(text) == spoken


def test_no_digits_survive() -> None:
    for text in ["Room 42, floor 7.", "第3章第12节", "v2.5 & 10:30"]:
        assert not any(ch.isdigit() for ch in speakable(text))


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("[break_3] 12 apples[speed_2]", "[break_3] twelve apples[speed_2]"),
        ("你好[break_3]，2026年[oral_2]", "你好[break_3]，二零二六年[oral_2]"),
        ("Hello [uv_break] world 3 [laugh]", "Hello [uv_break] world three [laugh]"),
    ],
)
def test_tags_are_left_alone(text: str, spoken: str) -> None:
    assert speakable(text) == spoken


def test_number_words_have_no_pause_marks() -> None:
    """ChatTTS's normalizer turns "-" and "," into pauses, so number words must not carry them."""
    spoken = speakable("42 and 1,234,567 and 2026")
    assert "-" not in spoken and "," not in spoken


def test_accented_latin_letters_are_folded_not_dropped() -> None:
    assert speakable("Café naïve résumé, Ægir, Straße, Łódź.") == "Cafe naive resume, AEgir, Strasse, Lodz."
    assert speakable("Ελληνικά 你好") == "Ελληνικά 你好"  # other scripts are left to ChatTTS's normalizer
