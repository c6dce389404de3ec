"""Word timestamps for one segment: the words the model speaks, and where each lies in its audio.

ChatTTS has no duration predictor and no alignment, so the times are estimated from what is
known exactly: the segment's text and its audio span. Two steps, both pure:

1. :func:`spoken_words`: the segment as the model hears it (our number speller,
   :func:`server.text.normalize.speakable`: "3" is "three", "2026年" is "二零二六年"), cut into
   words: Latin text by word, Chinese by character. Control tags are no word: a pause tag
   (``[uv_break]``, ``[break_3]``…) makes a pause after the word before it likely, a
   ``[laugh]`` is a sound between words (timed, never reported), the others say nothing
   about timing. Each word has a weight, its expected share of the speaking time: syllables
   (vowel groups in Latin words, one per Chinese character) plus a share per consonant.
2. :func:`align`: the segment's samples are cut into speech and pauses by their energy
   (10 ms frames; a pause is a run below the segment's loud level minus ``silence_db``). The
   first word starts where speech starts and the last ends where it ends. A dynamic
   programme then decides which pauses fall between which words and which lie inside a
   word (a stop consonant's closure): it weighs how well the speech between two chosen
   pauses matches the weights of its words (at the segment's own speaking rate) against how
   likely a pause is at each word boundary (punctuation, pause tags) and how unlikely a long
   silence is inside a word. Between two pauses, words share the time by their weights.

The method and its measured error on speech with known word boundaries (espeak-ng, English
and Mandarin): ``python -m bench.words``, bench/results/words/xeon-2core.md, and
docs/protocol.md ("Word timestamps (method)").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from server.text.alignment import Span, find_speech, layout, snap
from server.text.normalize import speakable
from server.text.tags import TAG

#: A Latin word (letters and digits, inner apostrophes: "don't") or one Chinese character.
_WORD: Final = re.compile(r"[A-Za-z0-9]+(?:['’][A-Za-z]+)*|[\u4e00-\u9fff]")
_VOWEL_GROUPS: Final = re.compile(r"[aeiouy]+")
_CONSONANTS: Final = re.compile(r"[b-df-hj-np-tv-xz]")
#: Punctuation after which a speaker pauses: sentence ends, then clause marks.
_FULL_STOP: Final = re.compile(r"[.!?;。！？；…]")
_CLAUSE: Final = re.compile(r"[,:，：、—–\-()（）\"“”]")
#: Tags that ask the model for a pause where they stand.
_PAUSE_TAGS: Final = re.compile(r"\[(?:uv_break|v_break|lbreak|break_\d)\]")
#: A tag that is a sound but no word.
_SOUND_TAGS: Final = re.compile(r"\[laugh\]")
#: Chinese particles spoken in the neutral tone: short syllables.
_LIGHT_CJK: Final = frozenset("的了吗呢吧啊呀着们么")
_TAG_SPLIT: Final = re.compile(rf"({TAG.pattern})")


@dataclass(frozen=True, slots=True)
class Word:
    """One unit of a segment's speech, as :func:`align` times it.

    Attributes:
        text: the word as spoken (numbers spelled out); ``""`` for a sound that is no word
            (``[laugh]``): it is timed so that the words around it are not, and never reported.
        weight: its expected share of the speaking time (syllable-like units).
        pause_after: what the text says about a pause after it: ``UNMARKED``, ``CLAUSE`` or
            ``FULL_STOP``.
    """

    text: str
    weight: float
    pause_after: int = 0


class TimedWord(NamedTuple):
    """A word and its samples in its segment's audio: ``start`` ≤ sample < ``end``."""

    word: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class AlignParams:
    """The aligner's constants (the defaults are the measured choice: bench/words/timing.py).

    Attributes:
        frame_s: energy frame (and time resolution) in seconds.
        silence_db: a frame is silent below the segment's loud level (95th percentile) minus this.
        min_pause_s: the shortest silence that may be a pause between words.
        min_sound_s: shorter bursts of sound inside a pause are clicks and count as silence.
        consonant_weight: weight of one consonant against a syllable's 1.
        cjk_weight: weight of one Chinese character (a syllable and its initial).
        light_weight: factor for the weight of a particle spoken in the neutral tone ("的", "了").
        p_pause: how likely a pause is at a word boundary with no punctuation, a clause mark
            and a full stop (or a pause tag).
        inner_pause_s: silence inside a word costs one unit (log-likelihood) per this many seconds.
        duration_spread: the variance of a group's duration, in seconds per second of expected
            duration (how far a speaker strays from the segment's mean rate).
        final_lengthening: weight added to a Latin word and to a Chinese character before a
            punctuation mark or a pause tag and at the segment's end (speakers slow down before
            a pause).
        snap_s: move a boundary inside running speech to the quietest frame this near, before a
            Latin word and before a Chinese character (0: not moved).
        use_pauses: assign pauses to boundaries (False: words share the speech time by weight).
    """

    frame_s: float = 0.01
    silence_db: float = 30.0
    min_pause_s: float = 0.06
    min_sound_s: float = 0.03
    consonant_weight: float = 0.8
    cjk_weight: float = 1.3
    light_weight: float = 0.6
    p_pause: tuple[float, float, float] = (0.08, 0.7, 0.9)
    inner_pause_s: float = 0.03
    duration_spread: float = 0.03
    final_lengthening: tuple[float, float] = (1.5, 0.0)
    snap_s: tuple[float, float] = (0.03, 0.08)
    use_pauses: bool = True


DEFAULT: Final = AlignParams()
#: ``Word.pause_after`` values: nothing marked, a clause mark ("," "、" "—"), a full stop or a
#: pause tag (the index into ``AlignParams.p_pause``).
UNMARKED: Final = 0
CLAUSE: Final = 1
FULL_STOP: Final = 2


def spoken_words(segment: str, params: AlignParams = DEFAULT) -> list[Word]:
    """The words the model speaks for ``segment``, in order, each with its weight and pause prior.

    Latin text by word, Chinese by character, numbers as our speller spells them; tags are no
    word (``[laugh]`` becomes a sound with ``text=""``). Characters the model does not speak
    (other scripts, emoji) make no word.
    """
    text = speakable(segment)
    units: list[Word] = []
    gap = ""  # what lies between the last word and the next: punctuation, blanks, tags
    for part in _TAG_SPLIT.split(text):
        if TAG.fullmatch(part):
            gap += part
            continue
        done = 0
        for match in _WORD.finditer(part):
            _mark_gap(units, gap + part[done : match.start()], params)
            gap = ""
            units.append(Word(match.group(), _weight(match.group(), params)))
            done = match.end()
        gap += part[done:]
    _mark_gap(units, gap, params)
    return [_lengthened(u, last=i == len(units) - 1, params=params) for i, u in enumerate(units)]


def _lengthened(unit: Word, *, last: bool, params: AlignParams) -> Word:
    if unit.text and (last or unit.pause_after > 0):
        extra = params.final_lengthening[1 if _is_cjk(unit.text) else 0]
        return replace(unit, weight=unit.weight + extra)
    return unit


def _mark_gap(units: list[Word], gap: str, params: AlignParams) -> None:
    """Fold what lies between two words (punctuation, tags) into the units."""
    if not gap.strip():
        return
    marks = TAG.sub("", gap)
    if _FULL_STOP.search(marks) or _PAUSE_TAGS.search(gap):
        level = FULL_STOP
    else:
        level = CLAUSE if _CLAUSE.search(marks) else UNMARKED
    if units and level > units[-1].pause_after:
        units[-1] = replace(units[-1], pause_after=level)
    for _ in _SOUND_TAGS.finditer(gap):
        units.append(Word("", 2.0 + 2 * params.consonant_weight, CLAUSE))


def _is_cjk(word: str) -> bool:
    return len(word) == 1 and "\u4e00" <= word <= "\u9fff"


def _weight(word: str, params: AlignParams) -> float:
    if _is_cjk(word):
        return params.cjk_weight * (params.light_weight if word in _LIGHT_CJK else 1.0)
    if word.isdigit():  # digits left by the speller are read one by one
        return len(word) * (1 + params.consonant_weight)
    letters = word.lower().replace("'", "").replace("’", "")
    if word.isupper() and (len(word) <= 3 or not _VOWEL_GROUPS.search(letters)):
        return len(word) * (1 + params.consonant_weight)  # spelled out: "USB", "TV"
    return syllables(letters) + params.consonant_weight * len(_CONSONANTS.findall(letters))


def syllables(word: str) -> int:
    """An estimate of the syllables of a lower-case English word: its vowel groups, less silent endings."""
    count = len(_VOWEL_GROUPS.findall(word))
    if count > 1 and word.endswith("e") and not word.endswith(("le", "ee", "ye")):
        count -= 1  # "make", "there"
    if count > 1 and word.endswith("ed") and not word.endswith(("ted", "ded")):
        count -= 1  # "walked"
    if (
        count > 1
        and word.endswith("es")
        and not word.endswith(("les", "ses", "zes", "ces", "ges", "xes", "shes", "ches"))
    ):
        count -= 1  # "makes"
    return max(1, count)


def align(
    words: list[Word], samples: npt.NDArray[np.float32], sample_rate: int, params: AlignParams = DEFAULT
) -> list[TimedWord]:
    """Where each word lies in its segment's audio (sample offsets from the segment's first sample).

    Every word with text is reported once, in order, with ``0 <= start < end <= len(samples)``
    and each word's ``end`` at or before the next one's ``start``.

    Raises:
        ValueError: fewer samples than words (no span can hold them all).
    """
    if not words:
        return []
    total = len(samples)
    if total < len(words):
        raise ValueError(f"{total} samples cannot hold {len(words)} words")
    speech = find_speech(
        np.asarray(samples, dtype=np.float32),
        sample_rate,
        frame_s=params.frame_s,
        silence_db=params.silence_db,
        min_pause_s=params.min_pause_s,
        min_sound_s=params.min_sound_s,
    )
    if not params.use_pauses:
        speech = replace(speech, pauses=[])
    weights = np.array([max(w.weight, 1e-3) for w in words])
    prior = np.array([params.p_pause[w.pause_after] for w in words[:-1]])
    spans = layout(weights, prior, speech, inner_pause_s=params.inner_pause_s, spread=params.duration_spread)
    spans = snap(spans, speech, [params.snap_s[1 if _is_cjk(w.text) else 0] for w in words[1:]])
    return _to_samples(words, spans, sample_rate, total)


def _to_samples(words: list[Word], spans: list[Span], sample_rate: int, total: int) -> list[TimedWord]:
    """Seconds to sample offsets: each unit at least one sample, in order, inside the span."""
    timed: list[TimedWord] = []
    count = len(words)
    previous_end = 0
    for i, (word, (t0, t1)) in enumerate(zip(words, spans, strict=True)):
        # Room is left for the units still to come, one sample each.
        start = min(max(round(t0 * sample_rate), previous_end), total - (count - i))
        end = min(max(round(t1 * sample_rate), start + 1), total - (count - i - 1))
        previous_end = end
        if word.text:
            timed.append(TimedWord(word.text, start, end))
    return timed
