from __future__ import annotations

import pytest

pytest.importorskip("cn2an")

from server.normalize import speakable


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("I have 123 apples.", "I have one hundred and twenty-three apples."),
        ("It costs $1,200 & tax.", "It costs one thousand, two hundred dollars and tax."),
        (
            "In 2026, 50% were -3.5 points up.",
            "In twenty twenty-six, fifty percent were minus three point five points up.",
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
