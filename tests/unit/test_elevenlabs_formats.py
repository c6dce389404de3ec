"""The ElevenLabs front end's pure parts: output formats, speed, and the character alignment."""

from __future__ import annotations

import pytest

from server.frontends.elevenlabs.alignment import rest_alignment, ws_alignment
from server.frontends.elevenlabs.formats import ElevenLabsError, output_format, speed_of, voice_settings
from server.frontends.messages import BadMessage
from server.streams.items import Words, WordSpan


@pytest.mark.parametrize(
    ("name", "ours", "rate"),
    [
        ("pcm_16000", "pcm16", 16_000),
        ("ulaw_8000", "mulaw", 8_000),
        ("mp3_24000_48", "mp3", 24_000),
        ("opus_48000_64", "ogg", 48_000),
        (None, "mp3", 24_000),
    ],
)
def test_output_formats_we_make(name: str | None, ours: str, rate: int) -> None:
    made = output_format(name)
    assert (made.format, made.sample_rate) == (ours, rate) and made.content_type.startswith("audio/")


@pytest.mark.parametrize(
    "name", ["mp3_44100_128", "mp3_22050_32", "pcm_22050", "alaw_8000", "wav_24000", "x"]
)
def test_output_formats_we_cannot_make_are_refused_with_the_list(name: str) -> None:
    with pytest.raises(ElevenLabsError) as refused:
        output_format(name)
    assert refused.value.status == 400 and "pcm_24000" in refused.value.message


def test_only_speed_is_taken_from_voice_settings_and_it_is_clamped() -> None:
    assert speed_of(voice_settings({"speed": 1.2, "stability": 0.3})) == 1.2
    assert (
        speed_of(voice_settings({"speed": 4.0})) == 2.0 and speed_of(voice_settings({"speed": 0.25})) == 0.5
    )
    assert speed_of(None) == 1.0 and speed_of(voice_settings({"stability": None, "extra": "x"})) == 1.0


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("fast", "$.voice_settings"),
        ([1], "$.voice_settings"),
        ({"speed": True}, "$.voice_settings.speed"),
        ({"speed": "1.0"}, "$.voice_settings.speed"),
        ({"speed": 4.5}, "$.voice_settings.speed"),
        ({"speed": 10**30}, "$.voice_settings.speed"),
        ({"stability": 2}, "$.voice_settings.stability"),
        ({"use_speaker_boost": 1}, "$.voice_settings.use_speaker_boost"),
    ],
)
def test_voice_settings_of_the_wrong_shape_are_refused_naming_the_field(value: object, where: str) -> None:
    with pytest.raises(BadMessage) as refused:
        voice_settings(value)
    assert refused.value.path == where and where in refused.value.message


def test_a_segment_s_characters_tile_its_span_exactly() -> None:
    words = Words(0, 24_000, 72_000, (WordSpan("hi", 26_400, 36_000), WordSpan("you", 40_800, 60_000)))
    relative = ws_alignment(words, 24_000, origin=words.start)
    assert relative["chars"] == ["h", "i", " ", "y", "o", "u", " "]
    assert relative["charStartTimesMs"] == [100, 300, 500, 700, 967, 1233, 1500]
    # The last character ends at the segment's end: a clock adding spans stays on the audio.
    assert relative["charStartTimesMs"][-1] + relative["charDurationsMs"][-1] == 2000
    absolute = ws_alignment(words, 24_000, origin=0)
    assert [t - 1000 for t in absolute["charStartTimesMs"]] == relative["charStartTimesMs"]
    rest = rest_alignment(words, 24_000)
    assert rest["character_end_times_seconds"][-1] == 3.0 and rest["characters"] == relative["chars"]


def test_a_segment_without_words_is_one_space_over_its_span() -> None:
    alignment = ws_alignment(Words(0, 0, 4_800, ()), 24_000, origin=0)
    assert alignment == {"chars": [" "], "charStartTimesMs": [0], "charDurationsMs": [200]}
