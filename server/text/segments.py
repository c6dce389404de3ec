"""Text preparation: sentence segmentation for Chinese and Latin text, length limits.

Segments are what the engine generates one at a time: short enough to bound
the model's memory and keep the first audio early, long enough to keep
prosody natural. Everything here is pure and fast.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

from server.engine_api import TOKENS_PER_LETTER, speech_tokens
from server.text import tags

#: Characters that end a sentence whatever follows (CJK and unambiguous Latin).
_HARD_END: Final = "。！？!?；;…"
#: Closing quotes/brackets that belong to the sentence before them.
_CLOSERS: Final = "\"'”’」』)）]】"
#: Sentence ends: hard punctuation, or a Latin full stop followed by space/end
#: (so "3.14" and "e.g.x" are not split), or a line break.
_SENTENCE_END: Final = re.compile(rf"(?:[{re.escape(_HARD_END)}]+|\.+(?=\s|$)|\n+)[{re.escape(_CLOSERS)}]*")
#: Where an over-long sentence may be cut when it has no sentence end.
_CLAUSE_END: Final = re.compile(r"[，,、：:—]+|\s+")
_SPACES: Final = re.compile(r"[ \t\r\f\v]+")

DEFAULT_MAX_SEGMENT_CHARS: Final = 120
DEFAULT_MIN_SEGMENT_CHARS: Final = 4
#: A ``flush`` speaks at once when its text holds at least this much speech (16 Latin letters,
#: 8 CJK characters or 3 digits: a clause) or ends a sentence; shorter text waits to merge with
#: what follows. Every segment costs a prefill and :data:`server.engine_api.SEGMENT_BASE_TOKENS`
#: of allowance, so a clause-sized minimum keeps a storm of tiny flushes within 1.25x the work
#: of its text sent at once.
FLUSH_MIN_SPEECH_TOKENS: Final = 16 * TOKENS_PER_LETTER
#: Text that ends a sentence (or a line), closers and blanks after it allowed.
_ENDS_SENTENCE: Final = re.compile(rf"(?:[{re.escape(_HARD_END)}]|\.|\n)[{re.escape(_CLOSERS)}]*\s*$")


def clean(text: str) -> str:
    """Collapse runs of blanks and strip; keeps line breaks (they end sentences)."""
    return _SPACES.sub(" ", text).strip()


def split_complete(text: str) -> tuple[list[str], str]:
    """Split off every complete sentence of ``text``.

    Returns:
        The complete sentences (stripped, non-empty) and the unfinished rest
        (unstripped, so more text can be appended to it).
    """
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end()
        # A Latin "." directly before a closer at the very end could still be
        # followed by more text in an incremental stream; only the regex decides.
        piece = text[start:end].strip()
        if piece:
            sentences.append(piece)
        start = end
    return sentences, text[start:]


def _cut_long(sentence: str, max_chars: int) -> list[str]:
    """Cut a sentence longer than ``max_chars`` at clause ends, else hard."""
    pieces: list[str] = []
    rest = sentence
    while len(rest) > max_chars:
        window = rest[: max_chars + 1]
        cut = 0
        for match in _CLAUSE_END.finditer(window):
            if match.end() <= max_chars:
                cut = match.end()
        if cut < max_chars // 3:  # no useful clause end: cut hard at the limit, never inside a tag
            cut = tags.safe_cut(rest, max_chars)
        head = rest[:cut].strip()
        if head:
            pieces.append(head)
        rest = rest[cut:].lstrip()
    if rest.strip():
        pieces.append(rest.strip())
    return pieces


def split_segments(
    text: str,
    *,
    max_chars: int = DEFAULT_MAX_SEGMENT_CHARS,
    min_chars: int = DEFAULT_MIN_SEGMENT_CHARS,
) -> list[str]:
    """Split text into speakable segments of at most ``max_chars`` characters.

    Sentences end at CJK or Latin terminal punctuation or a line break; a
    sentence longer than ``max_chars`` is cut at a clause boundary; pieces
    shorter than ``min_chars`` (such as "OK.") are joined to their
    neighbour when the result still fits.
    """
    sentences, rest = split_complete(clean(text))
    if rest.strip():
        sentences.append(rest.strip())
    pieces = [piece for sentence in sentences for piece in _cut_long(sentence, max_chars)]
    merged: list[str] = []
    for piece in pieces:
        if merged and (_spoken_len(piece) < min_chars or _spoken_len(merged[-1]) < min_chars):
            joined = _join(merged[-1], piece)
            if len(joined) <= max_chars:
                merged[-1] = joined
                continue
        merged.append(piece)
    return merged


def _spoken_len(piece: str) -> int:
    return len(tags.TAG.sub("", piece))


def _join(left: str, right: str) -> str:
    """Join two pieces with a space only between Latin characters."""
    if left and right and left[-1].isascii() and right[0].isascii():
        return f"{left} {right}"
    return left + right


def has_speakable(text: str) -> bool:
    """Whether ``text`` has anything the model can say.

    ChatTTS speaks Chinese and English: its normalizer deletes every character outside CJK
    unified ideographs, A-Z and a little punctuation, so a segment in another script would reach
    the model as an empty prompt and the model would babble. What survives our speller
    (:func:`server.text.normalize.speakable`: digits of any script become words, accented Latin
    letters are folded to A-Z) and that normalizer counts; blanks, punctuation, emoji and other
    scripts do not (``tests/model/test_text_pipeline.py`` holds this equal to the real pipeline).
    Control tags are not words: a segment of tags alone (``[laugh][laugh]``) would give the model
    a wordless prompt, and it babbles over one.
    """
    return any(_model_speaks(ch) for ch in tags.TAG.sub("", text))


def _model_speaks(ch: str) -> bool:
    if "\u4e00" <= ch <= "\u9fff" or ch.isdecimal():
        return True
    return ch.isalpha() and (ch.isascii() or "\u00c0" <= ch <= "\u024f")


def speakable_segments(sentences: list[str], *, max_chars: int) -> list[str]:
    """Cut each sentence to ``max_chars`` and drop pieces with nothing to speak."""
    return [
        piece for sentence in sentences for piece in _cut_long(sentence, max_chars) if has_speakable(piece)
    ]


class TooManyTokens(ValueError):
    """A piece of text with no clause end or space is over the model's prompt budget.

    Attributes:
        piece: the piece (a long number, a run of letters).
        tokens: what it is for the model.
    """

    def __init__(self, piece: str, tokens: int) -> None:
        super().__init__(piece, tokens)
        self.piece, self.tokens = piece, tokens


def fit_tokens(segment: str, count: Callable[[str], int], limit: int, *, hard: bool = False) -> list[str]:
    """``segment`` cut until each piece is at most ``limit`` tokens by ``count``.

    A piece over the limit is cut at the clause end (``,`` ``、`` ``:``…) nearest its middle, else
    at the space nearest its middle, so no word or number is broken; pieces with nothing to speak
    are left out.

    Raises:
        TooManyTokens: a piece over the limit has neither (unless ``hard``: it is cut in half).
    """
    tokens = count(segment)
    if tokens <= limit:
        return [segment]
    cut = _middle_cut(segment)
    if cut is None:
        if not hard or len(segment) < 2:
            raise TooManyTokens(segment, tokens)
        cut = tags.safe_cut(segment, len(segment) // 2)
        if not 0 < cut < len(segment):  # one tag: nothing to cut
            raise TooManyTokens(segment, tokens)
    halves = (segment[:cut].strip(), segment[cut:].strip())
    return [p for half in halves if has_speakable(half) for p in fit_tokens(half, count, limit, hard=hard)]


def _middle_cut(text: str) -> int | None:
    """The clause end nearest the middle of ``text``, else its space nearest the middle (None: neither)."""
    ends = [m for m in _CLAUSE_END.finditer(text) if m.start() > 0 and m.end() < len(text)]
    marks = [m.end() for m in ends if m.group().strip()] or [m.end() for m in ends]
    return min(marks, key=lambda at: abs(2 * at - len(text)), default=None)


def unbreakable_runs(text: str) -> list[str]:
    """The runs of ``text`` that :func:`fit_tokens` cannot cut (between clause ends and spaces)."""
    return [run for run in _CLAUSE_END.split(text) if run]


def last_run_start(text: str) -> int:
    """Where the last run of ``text`` begins: text appended later may continue it."""
    ends = list(_CLAUSE_END.finditer(text))
    return ends[-1].end() if ends else 0


class TextBuffer:
    """Text that arrives in pieces (an LLM's tokens), released as speakable segments.

    Complete sentences are released as soon as they are complete. A Latin full
    stop at the very end of the buffer is held back until the next character
    shows it is not a decimal point or an abbreviation ("3." + "14").
    """

    def __init__(self, *, max_chars: int = DEFAULT_MAX_SEGMENT_CHARS) -> None:
        self.max_chars = max_chars
        self._pending = ""

    @property
    def pending(self) -> str:
        """Text received but not yet released."""
        return self._pending

    def append(self, text: str) -> list[str]:
        """Add text; return the segments that are now complete."""
        self._pending += text
        sentences, rest = split_complete(self._pending)
        if sentences and not rest and self._pending.rstrip(_CLOSERS).endswith("."):
            rest = self._pending[self._pending.rfind(sentences[-1]) :]
            sentences.pop()
        self._pending = rest
        return speakable_segments(sentences, max_chars=self.max_chars)

    def take_clause(self) -> list[str]:
        """The text stalled: release it up to its last clause boundary, or all of it.

        An unfinished control tag at the end ("... [uv_") is never released: its
        closing bracket may still come.
        """
        ready = self._pending[: tags.open_tail(self._pending)]
        cut = 0
        for match in _CLAUSE_END.finditer(ready):
            if match.group().strip():  # a punctuation mark, not just a space
                cut = match.end()
        if cut == 0 or not has_speakable(ready[cut:]):
            cut = len(ready)
        head, self._pending = self._pending[:cut], self._pending[cut:]
        head = clean(head)
        return speakable_segments([head], max_chars=self.max_chars) if head else []

    def flush_ready(self) -> bool:
        """Whether a ``flush`` should speak the pending text now rather than merge it with more.

        It should when the text ends a sentence (a sentence's latency is kept) or holds a clause's
        worth of speech (:data:`FLUSH_MIN_SPEECH_TOKENS`); a fragment ("a", "the") waits.
        """
        text = self._pending
        return bool(_ENDS_SENTENCE.search(text)) or speech_tokens(text) >= FLUSH_MIN_SPEECH_TOKENS

    def take_all(self) -> list[str]:
        """Release everything buffered (``flush``, ``end``)."""
        text, self._pending = clean(self._pending), ""
        return speakable_segments([text], max_chars=self.max_chars) if text else []
