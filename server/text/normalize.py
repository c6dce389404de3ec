"""Text normalization: numbers and symbols are spelled out so that the model speaks them.

ChatTTS's tokenizer has no digits worth speaking (without a normalizer, "123 apples"
is spoken as "apples"). Chinese text goes through ``cn2an`` (which also reads dates,
percentages and negative numbers: "2026年" → "二零二六年"); Latin text through
``num2words``. A sentence counts as Chinese when it has any CJK character.

Control tags (``[uv_break]``, ``[break_3]``: :mod:`server.text.tags`) are left exactly as they
are: only the text between them is spelled out, so ``[break_3]`` never becomes ``[break_three]``.

Latin letters with accents are folded to A-Z ("Café" → "Cafe"): ChatTTS's normalizer
would delete them.

Number words carry no hyphens or commas ("forty two", "one thousand two hundred"):
ChatTTS's normalizer, which runs next, turns both into pauses.

Limits (documented in docs/protocol.md): no currencies beyond ``$``, no ordinals
("3rd" stays as written), no units, times ("10:30") are read as two numbers, and a
number glued to a Latin word ("mp3") is spelled out after a space.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final

import cn2an
from num2words import num2words

from server.text.tags import TAG

_CJK: Final = re.compile(r"[\u3400-\u9fff]")
_NUMBER: Final = re.compile(r"(?<![\d.])(-?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(%?)")
_EN_SYMBOLS: Final = {"&": " and ", "+": " plus ", "=": " equals ", "@": " at ", "#": " number "}
_ZH_SYMBOLS: Final = {"&": "和", "+": "加", "=": "等于", "@": "艾特", "#": "井号"}
#: Latin letters with diacritics (Latin-1 Supplement, Latin Extended-A/B).
_ACCENTED: Final = re.compile(r"[\u00c0-\u024f]")
_FOLD: Final = {
    "Æ": "AE",
    "æ": "ae",
    "Ø": "O",
    "ø": "o",
    "ß": "ss",
    "Œ": "OE",
    "œ": "oe",
    "Ð": "D",
    "ð": "d",
} | {
    "Ł": "L",
    "ł": "l",
    "Đ": "D",
    "đ": "d",
    "Þ": "Th",
    "þ": "th",
}
_DOLLARS: Final = re.compile(r"\$\s?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")


def speakable(text: str) -> str:
    """``text`` with numbers and common symbols written out in its language; tags kept as they are."""
    text = _ACCENTED.sub(_fold_accent, text)
    chinese = _CJK.search(text) is not None
    spell = _chinese if chinese else _english
    parts: list[str] = []
    done = 0
    for tag in TAG.finditer(text):
        parts += [spell(text[done : tag.start()]), tag.group()]
        done = tag.end()
    parts.append(spell(text[done:]))
    spoken = "".join(parts)
    return spoken if chinese else re.sub(r"\s{2,}", " ", spoken).strip()


def _fold_accent(match: re.Match[str]) -> str:
    """Fold "é" to "e": ChatTTS's normalizer deletes every letter outside A-Z ("Café" → "Caf")."""
    char = match.group()
    if char in _FOLD:
        return _FOLD[char]
    base = "".join(c for c in unicodedata.normalize("NFKD", char) if not unicodedata.combining(c))
    return base if base.isascii() else char


def _chinese(text: str) -> str:
    for symbol, word in _ZH_SYMBOLS.items():
        text = text.replace(symbol, word)
    try:
        return str(cn2an.transform(text, "an2cn"))
    except (ValueError, KeyError):  # cn2an rejects some number shapes; speak digits one by one
        return re.sub(r"\d", lambda m: "零一二三四五六七八九"[int(m.group())], text)


def _words(number: float) -> str:
    """num2words without its hyphens and commas: ChatTTS's normalizer reads both as pauses."""
    return str(num2words(number)).replace("-", " ").replace(",", "")


def _dollars(match: re.Match[str]) -> str:
    whole, fraction = match.group(1).replace(",", ""), match.group(2)
    if fraction is not None and len(fraction) > 2:  # not cents: "$1.999" is a decimal amount
        return f"{_words(float(f'{whole}.{fraction}'))} dollars"
    dollars, cents = int(whole), int((fraction or "0").ljust(2, "0"))
    spoken = [] if cents and not dollars else [f"{_words(dollars)} dollar{'' if dollars == 1 else 's'}"]
    if cents:
        spoken.append(f"{_words(cents)} cent{'' if cents == 1 else 's'}")
    return " ".join(spoken)


def _english(text: str) -> str:
    text = _DOLLARS.sub(_dollars, text)
    for symbol, word in _EN_SYMBOLS.items():
        text = text.replace(symbol, word)
    return _NUMBER.sub(lambda m: _english_number(m, text), text)


def _english_number(match: re.Match[str], text: str) -> str:
    sign, whole, fraction, percent = match.groups()
    # A number glued to a word ("v2", "mp3") keeps a space so both are spoken.
    space = " " if match.start() > 0 and text[match.start() - 1].isalpha() else ""
    digits = whole.replace(",", "")
    if fraction is None and not sign and not percent and "," not in whole and 1100 <= int(digits) <= 2099:
        # "2026" → "twenty twenty six"; hyphens would become pauses in ChatTTS's normalizer.
        words = str(num2words(int(digits), to="year")).replace("-", " ")
    else:
        value = float(f"{digits}.{fraction}") if fraction else int(digits)
        words = _words(-value if sign else value)
    return space + (f"{words} percent" if percent else words)
