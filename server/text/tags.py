r"""ChatTTS control tags in user text: the grammar, validation, and where tags sit in a text.

A control tag is a name in square brackets, ``[uv_break]``. The names come from ChatTTS
0.2.5: the word-level controls its web UI offers (``[uv_break]``, ``[v_break]``,
``[lbreak]``, ``[laugh]``), the numbered controls its refinement prompt takes
(``[oral_0-9]``, ``[laugh_0-2]``, ``[break_0-7]``) and the speed controls of its code
prompt (``[speed_0-9]``); all are single tokens of ChatTTS's tokenizer. Tags pass through
our number speller and ChatTTS's normalizer untouched (its normalizer already keeps
``[\w+]`` groups) and reach the model as their token.

Square brackets are reserved for tags: any other ``[...]`` (``[foo]``, ``[break_99]``,
``[1]``), an unclosed ``[`` and a stray ``]`` are rejected with a message naming them,
because ChatTTS would pass the bracketed text to the model as characters it never saw
in training, and an unclosed ``[`` makes its normalizer drop the rest of the text. The
prompt's structural tokens (``[Stts]``, ``[spk_emb]``, ``[Ptts]``...) are the server's
to write and are rejected too. Write ``(...)`` or ``【...】`` for a literal bracket.

This module is pure (no model, no I/O) so the service can validate text at ``start`` and
``append`` before anything is queued.
"""

from __future__ import annotations

import re
from typing import Final

#: Tags without a number.
WORD_TAGS: Final = ("uv_break", "v_break", "lbreak", "laugh")
#: Numbered tags and their highest number (``[break_0]`` … ``[break_7]``).
NUMBERED_TAGS: Final = {"break": 7, "laugh": 2, "oral": 9, "speed": 9}
#: Every tag a user may write, with brackets.
ALLOWED: Final = frozenset(
    [f"[{name}]" for name in WORD_TAGS]
    + [f"[{name}_{k}]" for name, top in NUMBERED_TAGS.items() for k in range(top + 1)]
)
#: Prompt structure ChatTTS's code writes around the text (``Speaker.decorate_*``, ``Tokenizer``).
RESERVED: Final = frozenset(
    ["[Stts]", "[Ptts]", "[spk_emb]", "[empty_spk]", "[Sbreak]", "[Pbreak]", "[Ebreak]"]
)
#: What ChatTTS's own normalizer treats as a tag (``Normalizer.sub_pattern``).
TAG: Final = re.compile(r"\[\w+\]")
_BRACKET: Final = re.compile(r"[\[\]]")
_MAX_ECHO = 32


def allowed_summary() -> str:
    """The allowed tags in one line (for error messages and docs)."""
    words = ", ".join(f"[{w}]" for w in WORD_TAGS)
    numbered = ", ".join(f"[{name}_0-{top}]" for name, top in NUMBERED_TAGS.items())
    return f"{words}, {numbered}"


def _echo(text: str) -> str:
    return text if len(text) <= _MAX_ECHO else text[: _MAX_ECHO - 1] + "…"


def _unknown(tag: str) -> str:
    if tag in RESERVED:
        return f"{tag} belongs to the prompt the server writes around the text; it cannot appear in text"
    name = tag[1:-1]
    stem, _, number = name.rpartition("_")
    if stem in NUMBERED_TAGS and number.isdigit():
        top = NUMBERED_TAGS[stem]
        return f"control tag {tag} is out of range: {stem} goes from [{stem}_0] to [{stem}_{top}]"
    hint = f" (did you mean {tag.lower()}?)" if tag.lower() in ALLOWED else ""
    return (
        f"unknown control tag {_echo(tag)}{hint}; square brackets are reserved for ChatTTS's tags "
        f"({allowed_summary()}); write (...) for a literal bracket"
    )


def problem(text: str, *, open_end: bool = False) -> str | None:
    """Why ``text`` is not valid tagged text, or ``None`` when it is.

    Args:
        text: user text.
        open_end: the text may continue (an incremental stream's pending text): a final
            ``[`` whose name could still become an allowed tag is not an error yet.
    """
    depth_start = -1
    for match in _BRACKET.finditer(text):
        pos = match.start()
        if match.group() == "[":
            if depth_start >= 0:
                return f"unclosed tag {_echo(text[depth_start:pos])!r} at character {depth_start}"
            depth_start = pos
            continue
        if depth_start < 0:
            return f"stray ']' at character {pos} (square brackets are reserved for control tags)"
        tag = text[depth_start : pos + 1]
        if tag not in ALLOWED:
            return _unknown(tag)
        depth_start = -1
    if depth_start >= 0:
        tail = text[depth_start:]
        if not open_end:
            return f"unclosed tag {_echo(tail)!r} at character {depth_start}"
        if not any(tag.startswith(tail) for tag in ALLOWED):
            where = f"{_echo(tail)!r} at character {depth_start}"
            return f"{where} does not begin a control tag ({allowed_summary()})"
    return None


def open_tail(text: str) -> int:
    """Where an unfinished tag at the end of ``text`` starts (``len(text)`` when none)."""
    start = text.rfind("[")
    if start >= 0 and "]" not in text[start:]:
        return start
    return len(text)


def spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every tag-shaped group in ``text`` (ChatTTS's own pattern)."""
    return [m.span() for m in TAG.finditer(text)]


def safe_cut(text: str, cut: int) -> int:
    """``cut`` moved out of any tag it falls inside (to the tag's start, or its end at 0)."""
    for start, end in spans(text):
        if start < cut < end:
            return start if start > 0 else end
    return cut


#: What the refinement prompt (``refine_prompt``) may hold: ChatTTS's sentence-level controls.
REFINE_PROMPT_TAGS: Final = ("oral", "laugh", "break")


def refine_prompt_problem(prompt: str) -> str | None:
    """Why ``prompt`` is not a refinement prompt (``[oral_2][laugh_0][break_6]``), or ``None``.

    ChatTTS writes it after ``[Pbreak]`` as is; only its numbered sentence-level controls, each
    at most once, mean anything there.
    """
    rest = TAG.sub("", prompt)
    if rest.strip():
        text = _echo(rest.strip())
        return f"refine_prompt may only hold tags such as [oral_2][laugh_0][break_6], not {text!r}"
    seen: set[str] = set()
    for tag in TAG.findall(prompt):
        stem, _, number = tag[1:-1].rpartition("_")
        if stem not in REFINE_PROMPT_TAGS or not number.isdigit():
            return f"refine_prompt takes [oral_0-9], [laugh_0-2] and [break_0-7], not {_echo(tag)}"
        if tag not in ALLOWED:
            return _unknown(tag)
        if stem in seen:
            return f"refine_prompt sets [{stem}_N] twice"
        seen.add(stem)
    return None
