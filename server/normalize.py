"""Text normalization: numbers and symbols are spelled out so that the model speaks them.

ChatTTS's tokenizer has no digits worth speaking (without a normalizer, "123 apples"
is spoken as "apples"). Chinese text goes through ``cn2an`` (which also reads dates,
percentages and negative numbers: "2026年" → "二零二六年"); Latin text through
``num2words``. A sentence counts as Chinese when it has any CJK character.

Limits (documented in docs/protocol.md): no currencies beyond ``$``, no ordinals
("3rd" stays as written), no units, times ("10:30") are read as two numbers, and a
number glued to a Latin word ("mp3") is spelled out after a space.
"""

from __future__ import annotations

import re
from typing import Final

import cn2an
from num2words import num2words

_CJK: Final = re.compile(r"[\u3400-\u9fff]")
_NUMBER: Final = re.compile(r"(?<![\d.])(-?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(%?)")
_EN_SYMBOLS: Final = {"&": " and ", "+": " plus ", "=": " equals ", "@": " at ", "#": " number "}
_ZH_SYMBOLS: Final = {"&": "和", "+": "加", "=": "等于", "@": "艾特", "#": "井号"}
_DOLLARS: Final = re.compile(r"\$\s?(\d[\d,]*(?:\.\d+)?)")


def speakable(text: str) -> str:
    """``text`` with numbers and common symbols written out in its language."""
    if _CJK.search(text):
        return _chinese(text)
    return _english(text)


def _chinese(text: str) -> str:
    for symbol, word in _ZH_SYMBOLS.items():
        text = text.replace(symbol, word)
    try:
        return str(cn2an.transform(text, "an2cn"))
    except (ValueError, KeyError):  # cn2an rejects some number shapes; speak digits one by one
        return re.sub(r"\d", lambda m: "零一二三四五六七八九"[int(m.group())], text)


def _english(text: str) -> str:
    text = _DOLLARS.sub(lambda m: f"{m.group(1)} dollars", text)
    for symbol, word in _EN_SYMBOLS.items():
        text = text.replace(symbol, word)
    spoken = _NUMBER.sub(lambda m: _english_number(m, text), text)
    return re.sub(r"\s{2,}", " ", spoken).strip()


def _english_number(match: re.Match[str], text: str) -> str:
    sign, whole, fraction, percent = match.groups()
    # A number glued to a word ("v2", "mp3") keeps a space so both are spoken.
    space = " " if match.start() > 0 and text[match.start() - 1].isalpha() else ""
    digits = whole.replace(",", "")
    if fraction is None and not sign and not percent and "," not in whole and 1100 <= int(digits) <= 2099:
        words = num2words(int(digits), to="year")  # "2026" → "twenty twenty-six"
    else:
        value = float(f"{digits}.{fraction}") if fraction else int(digits)
        words = num2words(-value if sign else value)
    return space + (f"{words} percent" if percent else str(words))
