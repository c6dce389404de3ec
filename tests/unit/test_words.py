"""Word timestamps (server/text/words.py, alignment.py): the words of a segment and their times.

Pure logic on synthetic audio whose word boundaries are known by construction (tone bursts
with silences or dips between them). The accuracy on speech is measured by
``python -m bench.words`` (espeak-ng; tests/bench/words/test_smoke.py runs it).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.text.words import (
    CLAUSE,
    DEFAULT,
    FULL_STOP,
    UNMARKED,
    TimedWord,
    Word,
    align,
    spoken_words,
    syllables,
)

RATE = 24_000


def texts(units: list[Word]) -> list[str]:
    return [w.text for w in units]


# --- the words the model speaks --------------------------------------------------------------


def test_latin_by_word_chinese_by_character_numbers_as_spoken() -> None:
    assert texts(spoken_words("I have 3 apples, don't you?")) == [
        "I",
        "have",
        "three",
        "apples",
        "don't",
        "you",
    ]
    assert texts(spoken_words("你好，世界。")) == ["你", "好", "世", "界"]
    # Chinese text gets Chinese numbers, read as the speller reads them ("2026年" digit by digit).
    assert texts(spoken_words("2026年5月")) == ["二", "零", "二", "六", "年", "五", "月"]
    assert texts(spoken_words("It costs $12.50.")) == ["It", "costs", "twelve", "dollars", "fifty", "cents"]
    assert texts(spoken_words("Mixed 中文 text")) == ["Mixed", "中", "文", "text"]


def test_tags_are_no_word_but_a_laugh_is_a_sound_and_pause_tags_mark_a_pause() -> None:
    units = spoken_words("Hello [uv_break] world [laugh] again [speed_5] now")
    assert [w.text for w in units] == ["Hello", "world", "", "again", "now"]
    hello, _, laugh, again, _ = units
    assert hello.pause_after == FULL_STOP  # a pause tag: a pause is as likely as at a full stop
    assert laugh.text == "" and laugh.weight > 0  # timed, never reported
    assert again.pause_after == UNMARKED  # [speed_5] says nothing about a pause
    assert texts(spoken_words("[laugh][uv_break]")) == [""]
    assert spoken_words("[uv_break]") == []


def test_what_the_model_does_not_speak_makes_no_word() -> None:
    assert spoken_words("…!? 🙂 ——") == []
    assert texts(spoken_words("Привет hello")) == ["hello"]  # ChatTTS's normalizer deletes Cyrillic
    assert texts(spoken_words("Café naïve")) == ["Cafe", "naive"]  # folded to A-Z, as the model hears it


def test_pause_marks_from_punctuation() -> None:
    marks = {w.text: w.pause_after for w in spoken_words("one, two. three four; 五、六。七")}
    assert marks == {
        "one": CLAUSE,
        "two": FULL_STOP,
        "three": UNMARKED,
        "four": FULL_STOP,
        "五": CLAUSE,
        "六": FULL_STOP,
        "七": UNMARKED,
    }


def test_weights_follow_syllables_consonants_tone_and_lengthening() -> None:
    assert [syllables(w) for w in ("the", "make", "walked", "wanted", "apples", "beautiful")] == [
        1,
        1,
        1,
        2,
        2,
        3,
    ]
    light, full = spoken_words("的天")[0].weight, spoken_words("天的")[0].weight
    assert light < full  # a neutral-tone particle is a short syllable
    short, long = (spoken_words(t)[0].weight for t in ("cat dog", "strength dog"))
    assert long > short  # more consonants, longer word
    # A word before a pause mark and the segment's last word are lengthened (Latin text).
    middle, before_comma = spoken_words("home home")[0].weight, spoken_words("home, home")[0].weight
    assert before_comma == pytest.approx(middle + DEFAULT.final_lengthening[0])
    assert spoken_words("home home")[1].weight == before_comma


# --- alignment on audio with known boundaries -------------------------------------------------


def burst(seconds: float, freq: float = 180.0, level: float = 0.3) -> npt.NDArray[np.float32]:
    """A voiced-like stretch: a harmonic tone with a short fade at both ends."""
    t = np.arange(round(seconds * RATE)) / RATE
    tone = sum(np.sin(2 * np.pi * freq * h * t) / h for h in range(1, 6))
    fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)
    return (level * tone * fade).astype(np.float32)


def quiet(seconds: float, level: float = 1e-4, seed: int = 0) -> npt.NDArray[np.float32]:
    """A pause: a faint noise floor, as a model's pauses have."""
    return (np.random.default_rng(seed).standard_normal(round(seconds * RATE)) * level).astype(np.float32)


def speak(pieces: list[tuple[str, float]]) -> tuple[npt.NDArray[np.float32], list[int]]:
    """Audio from ("word"|"pause", seconds) pieces, and the sample where each piece starts."""
    parts, starts, at = [], [], 0
    for kind, seconds in pieces:
        part = (
            burst(seconds, freq=150 + 10 * len(parts)) if kind == "word" else quiet(seconds, seed=len(parts))
        )
        starts.append(at)
        parts.append(part)
        at += len(part)
    starts.append(at)
    return np.concatenate(parts), starts


def at_ms(sample: int) -> float:
    return sample / RATE * 1000


def test_a_pause_at_the_comma_is_the_boundary_and_speech_edges_are_found() -> None:
    words = spoken_words("Hello there my friend, how are you")
    # Word durations by weight (a steady speaker), 0.3 s of leading silence, a 0.35 s pause.
    rate = 0.07
    pieces = [("pause", 0.3)]
    for w in words:
        pieces.append(("word", w.weight * rate))
        if w.pause_after:
            pieces.append(("pause", 0.35))
    pieces.append(("pause", 0.4))
    audio, starts = speak(pieces)
    timed = align(words, audio, RATE)
    truth = [(starts[i], starts[i + 1]) for i, (kind, _) in enumerate(pieces) if kind == "word"]
    assert [w.word for w in timed] == texts(words)
    friend, how = timed[3], timed[4]
    assert abs(at_ms(friend.end) - at_ms(truth[3][1])) <= 15  # the pause's edges, to a frame
    assert abs(at_ms(how.start) - at_ms(truth[4][0])) <= 15
    assert abs(at_ms(timed[0].start) - 300) <= 15 and abs(at_ms(timed[-1].end) - at_ms(truth[-1][1])) <= 15
    for got, (start, end) in zip(timed, truth, strict=True):
        assert abs(at_ms(got.start) - at_ms(start)) <= 40 and abs(at_ms(got.end) - at_ms(end)) <= 40


def test_the_pause_goes_to_the_punctuated_boundary_not_the_nearest_by_weight() -> None:
    # The speaker drags the first clause and hurries the second.
    words = spoken_words("one two three four five six, seven eight")
    pieces: list[tuple[str, float]] = [
        ("word", w.weight * (0.085 if i < 6 else 0.055)) for i, w in enumerate(words)
    ]
    pieces.insert(6, ("pause", 0.3))
    audio, starts = speak(pieces)
    # By weight alone, the pause's place in the speech is nearer the boundary after "seven".
    cum = np.cumsum([w.weight for w in words])
    speech = starts[-1] - (starts[7] - starts[6])
    where = (starts[6] / speech) * cum[-1]
    assert abs(cum[6] - where) < abs(cum[5] - where)
    timed = align(words, audio, RATE)
    assert abs(at_ms(timed[5].end) - at_ms(starts[6])) <= 15  # "six" ends where the pause begins
    assert abs(at_ms(timed[6].start) - at_ms(starts[7])) <= 15  # "seven" starts where it ends


def test_where_the_durations_hesitate_the_punctuation_decides() -> None:
    # Four equal syllables, the pause after the first (the comma). The audio alone fits a pause
    # after the second a little better (0.45 s of speech, then 0.75 s): the comma tips it.
    words = spoken_words("天，天天天")
    audio, starts = speak([("word", 0.45), ("pause", 0.3), ("word", 0.75)])
    timed = align(words, audio, RATE)
    assert abs(at_ms(timed[0].end) - at_ms(starts[1])) <= 15
    assert abs(at_ms(timed[1].start) - at_ms(starts[2])) <= 15


def test_a_long_silence_is_a_boundary_even_without_punctuation() -> None:
    # The speaker stops for 0.4 s after "one": no comma, but no word holds such a silence.
    words = spoken_words("one two three")
    one, two, three = (w.weight * 0.07 for w in words)
    audio, starts = speak([("word", one), ("pause", 0.4), ("word", two), ("word", three)])
    timed = align(words, audio, RATE)
    assert abs(at_ms(timed[0].end) - at_ms(starts[1])) <= 15
    assert abs(at_ms(timed[1].start) - at_ms(starts[2])) <= 15


def test_a_short_silence_inside_a_word_is_not_a_boundary() -> None:
    # A steady speaker; "unbelievably" has a stop closure (70 ms of silence) after its first third.
    words = spoken_words("unbelievably long")
    first_s, second_s = (w.weight * 0.07 for w in words)
    pieces = [("word", first_s / 3), ("pause", 0.07), ("word", first_s * 2 / 3 - 0.07), ("word", second_s)]
    audio, starts = speak(pieces)
    first, second = align(words, audio, RATE)
    assert abs(at_ms(first.end) - at_ms(starts[3])) <= 30
    assert second.start == first.end


def test_a_boundary_in_running_speech_moves_into_the_energy_dip() -> None:
    # Two Chinese syllables of equal weight, the first shorter; a 30 ms dip (no pause) between.
    words = spoken_words("天天")
    audio = np.concatenate([burst(0.2), quiet(0.03, level=3e-3), burst(0.3)])
    first, second = align(words, audio, RATE)
    assert 200 <= at_ms(first.end) <= 230 and first.end == second.start
    # Without snapping the boundary stays where the weights put it (the middle).
    from dataclasses import replace

    plain = align(words, audio, RATE, replace(DEFAULT, snap_s=(0.0, 0.0)))
    assert abs(at_ms(plain[0].end) - 265) <= 15


def test_edge_cases() -> None:
    words = spoken_words("two words")
    assert align([], np.zeros(100, np.float32), RATE) == []
    with pytest.raises(ValueError, match="cannot hold"):
        align(words, np.zeros(1, np.float32), RATE)
    # Silence throughout: the words share the whole span by weight.
    share = round(2400 * words[0].weight / (words[0].weight + words[1].weight))
    silence = np.zeros(2400, np.float32)
    assert align(words, silence, RATE) == [TimedWord("two", 0, share), TimedWord("words", share, 2400)]
    # As many samples as units: one each.
    assert align(words, np.ones(2, np.float32), RATE) == [TimedWord("two", 0, 1), TimedWord("words", 1, 2)]


VOCAB = ["hello", "world", "三", "的", "strength", "a", "I", "USB", "42", "don't", "好"]
MARKS = ["", " ", ", ", ". ", "[uv_break]", "[laugh]", "[speed_3]", "、", "!"]


@st.composite
def segment_and_audio(draw: st.DrawFn) -> tuple[str, npt.NDArray[np.float32]]:
    text = "".join(
        draw(st.sampled_from(VOCAB)) + draw(st.sampled_from(MARKS)) for _ in range(draw(st.integers(1, 25)))
    )
    units = len(spoken_words(text))
    kind = draw(st.sampled_from(["speech", "silence", "constant", "tight"]))
    length = units if kind == "tight" else max(units, draw(st.integers(1, 5 * RATE)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "speech":  # noise with silent stretches of random length
        audio = rng.standard_normal(length).astype(np.float32) * 0.1
        for _ in range(draw(st.integers(0, 12))):
            a = draw(st.integers(0, length - 1))
            audio[a : a + draw(st.integers(1, RATE // 2))] = 0
    elif kind == "silence":
        audio = np.zeros(length, np.float32)
    else:
        audio = np.full(length, 0.2, np.float32)
    return text, audio


@settings(max_examples=300, deadline=None)
@given(segment_and_audio())
def test_every_word_once_in_order_inside_the_span_and_monotonic(
    case: tuple[str, npt.NDArray[np.float32]],
) -> None:
    text, audio = case
    units = spoken_words(text)
    timed = align(units, audio, RATE)
    assert [w.word for w in timed] == [u.text for u in units if u.text]
    previous_end = 0
    for word in timed:
        assert previous_end <= word.start < word.end <= len(audio)
        previous_end = word.end
