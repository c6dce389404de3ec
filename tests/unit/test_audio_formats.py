"""mp3, flac and mulaw encoders: exact sample accounting, real decoders, G.711 tables."""

from __future__ import annotations

import io
import subprocess

import numpy as np
import pytest
import soundfile

from server.audio import make_encoder
from server.audio.base import EncodedFrame
from server.audio.flac import FLAC_BLOCK, FLAC_HEADER_BYTES, FlacEncoder, with_total_samples
from server.audio.mp3 import (
    DECODER_DELAY,
    ENCODER_DELAY,
    Mp3Encoder,
    _crc16,
    frame_samples,
    info_frame,
    mp3_bitrates,
)
from server.audio.mulaw import DECODE_TABLE, ENCODE_TABLE, from_mulaw
from server.audio.pcm import to_pcm16
from tests.unit.audio_signals import speech_like

LEAD = ENCODER_DELAY + DECODER_DELAY  # 1105 samples before a non-gapless decoder's first stream sample


def encode(encoder: object, audio: np.ndarray, step: int) -> list[EncodedFrame]:
    frames: list[EncodedFrame] = []
    for pos in range(0, len(audio), step):
        frames += encoder.push(audio[pos : pos + step])  # type: ignore[attr-defined]
    return frames + encoder.finish()  # type: ignore[attr-defined]


def signal(rate: int, seconds: float = 1.5) -> np.ndarray:
    audio, _ = speech_like(seconds, rate=rate)
    return (0.5 * audio / np.max(np.abs(audio))).astype(np.float32)


def ffmpeg_decode(data: bytes, fmt: str) -> np.ndarray:
    """Decode a whole stream with Debian's ffmpeg to float32 samples."""
    out = subprocess.run(
        ["ffmpeg", "-v", "error", "-f", fmt, "-i", "pipe:0", "-f", "f32le", "pipe:1"],
        input=data,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return np.frombuffer(out.stdout, "<f4")


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    noise = reference - test
    return float(10 * np.log10(np.sum(reference**2) / max(np.sum(noise**2), 1e-12)))


# --- mp3 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [8_000, 16_000, 24_000, 48_000])
@pytest.mark.parametrize("step", [160, 4096, 100_000])
def test_mp3_samples_sum_to_the_stream_and_decode_aligned(rate: int, step: int) -> None:
    audio = signal(rate)
    frames = encode(Mp3Encoder(rate), audio, step)
    assert sum(f.samples for f in frames) == len(audio)
    assert frames[-1].payload and all(f.payload for f in frames)  # no empty frame, even the last
    data = b"".join(f.payload for f in frames)
    assert data.startswith(info_frame(rate))
    decoded, got_rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert got_rate == rate
    # libsndfile's mpg123 ignores the gapless tag: its output lags by exactly the codec delay.
    frame = frame_samples(rate)
    assert 0 <= len(decoded) - LEAD - len(audio) < frame
    # Aligned at exactly LEAD: the waveform matches there (MP3 is perceptual, and LAME's
    # low-pass removes the top of the band, so the SNR is modest) and nowhere next to it.
    snr = {lag: snr_db(audio, decoded[LEAD + lag : LEAD + lag + len(audio)]) for lag in (-2, -1, 0, 1, 2)}
    assert snr[0] > 5 and all(snr[0] > snr[lag] + 2 for lag in (-2, -1, 1, 2))


def test_mp3_frame_offsets_are_what_a_decoder_has_heard() -> None:
    audio = signal(24_000, 2.0)
    frames = encode(Mp3Encoder(24_000), audio, 2048)
    offsets = np.cumsum([0] + [f.samples for f in frames])
    for k in range(len(frames) - 1):
        partial = b"".join(f.payload for f in frames[: k + 1])
        decoded, _ = soundfile.read(io.BytesIO(partial), dtype="float32")
        # Every stream sample counted so far can be played from the bytes sent so far.
        assert len(decoded) - LEAD >= offsets[k + 1]
        assert len(decoded) - LEAD - offsets[k + 1] < frame_samples(24_000) or offsets[k + 1] == 0


@pytest.mark.parametrize("rate", [24_000, 48_000])
def test_ffmpeg_reads_the_info_tag(rate: int) -> None:
    audio = signal(rate)
    decoded = ffmpeg_decode(b"".join(f.payload for f in encode(Mp3Encoder(rate), audio, 4096)), "mp3")
    # ffmpeg skips the tag's delay (576 + 529) but, with no frame count in the tag, plays the
    # tag frame itself as one frame of silence: the stream starts exactly one frame in.
    # Without the tag it would start 1105 samples in.
    frame = frame_samples(rate)
    m = len(audio) - 2 * LEAD
    at_frame = snr_db(audio[:m], decoded[frame : frame + m])
    unskipped = frame + LEAD  # where the stream would be if the tag's delay were ignored
    assert at_frame > 5 and at_frame > snr_db(audio[:m], decoded[unskipped : unskipped + m]) + 2
    assert np.max(np.abs(decoded[: frame // 2])) < 0.01
    assert 0 <= len(decoded) - frame - len(audio) < frame


def test_info_frame_is_a_valid_lame_tag() -> None:
    assert _crc16(b"123456789") == 0xBB3D  # CRC-16/ARC check value
    for rate in (8_000, 16_000, 24_000, 48_000):
        tag = info_frame(rate)
        side = 17 if rate == 48_000 else 9
        assert tag[4 + side : 8 + side] == b"Info" and tag[12 + side : 21 + side] == b"LAME3.100"
        delay_pad = int.from_bytes(tag[side + 33 : side + 36], "big")
        assert (delay_pad >> 12, delay_pad & 0xFFF) == (ENCODER_DELAY, 0)
        assert int.from_bytes(tag[190:192], "big") == _crc16(tag[:190])


def test_mp3_options_and_errors() -> None:
    assert mp3_bitrates(24_000)[-1] == 160 and mp3_bitrates(48_000)[0] == 32
    enc = make_encoder("mp3", 24_000, mp3_bitrate=32)
    assert isinstance(enc, Mp3Encoder) and enc.bitrate == 32
    with pytest.raises(ValueError, match="bitrate"):
        Mp3Encoder(24_000, bitrate=320)
    with pytest.raises(ValueError, match="mp3 cannot encode"):
        Mp3Encoder(44_100)
    enc.finish()
    with pytest.raises(RuntimeError):
        enc.push(np.zeros(10, np.float32))


def test_mp3_of_an_empty_stream_is_one_decodable_frame() -> None:
    frames = Mp3Encoder(24_000).finish()
    assert len(frames) == 1 and frames[0].samples == 0 and frames[0].payload.startswith(info_frame(24_000))


# --- flac --------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [8_000, 24_000, 48_000])
@pytest.mark.parametrize("step", [FLAC_BLOCK, FLAC_BLOCK + 1, 1000, 100_000])
def test_flac_is_lossless_and_offsets_are_exact(rate: int, step: int) -> None:
    audio = signal(rate)
    frames = encode(FlacEncoder(rate), audio, step)
    assert sum(f.samples for f in frames) == len(audio)
    data = b"".join(f.payload for f in frames)
    assert data[:4] == b"fLaC" and int.from_bytes(data[18:21], "big") >> 4 == rate  # STREAMINFO
    # libsndfile cannot read a FLAC stream of unknown length (STREAMINFO total 0): ffmpeg can.
    decoded = ffmpeg_decode(data, "flac")
    assert np.array_equal(to_pcm16(decoded), to_pcm16(audio))  # lossless: the pcm16 samples
    # Each prefix of the stream decodes to exactly the samples the frames so far announced.
    total = 0
    for k, frame in enumerate(frames[:-1]):
        total += frame.samples
        if frame.samples and k % 3 == 0:
            prefix = b"".join(f.payload for f in frames[: k + 1])
            assert len(ffmpeg_decode(prefix, "flac")) == total


def test_flac_of_an_empty_stream_is_a_valid_file() -> None:
    frames = FlacEncoder(24_000).finish()
    assert len(frames) == 1 and frames[0].samples == 0 and frames[0].payload[:4] == b"fLaC"
    assert len(ffmpeg_decode(frames[0].payload, "flac")) == 0


@pytest.mark.parametrize("rate", [8_000, 48_000])
def test_a_flac_stream_with_its_length_written_in_opens_in_soundfile(rate: int) -> None:
    audio = signal(rate)
    data = b"".join(f.payload for f in encode(FlacEncoder(rate), audio, 1000))
    with pytest.raises((ValueError, soundfile.LibsndfileError)):  # length 0: "unknown"
        soundfile.read(io.BytesIO(data))
    complete = with_total_samples(data, len(audio))
    assert len(complete) == len(data) and complete[:18] == data[:18] and complete[26:] == data[26:]
    decoded, got_rate = soundfile.read(io.BytesIO(complete), dtype="int16")
    assert got_rate == rate and np.array_equal(decoded, to_pcm16(audio))


def test_with_total_samples_refuses_what_is_not_a_flac_header() -> None:
    data = b"".join(f.payload for f in encode(FlacEncoder(24_000), signal(24_000), 5000))
    with pytest.raises(ValueError, match="not a FLAC stream"):
        with_total_samples(b"RIFF" + data[4:], 10)
    with pytest.raises(ValueError, match="not a FLAC stream"):
        with_total_samples(data[: FLAC_HEADER_BYTES - 1], 10)  # STREAMINFO cut short
    with pytest.raises(ValueError, match="36-bit"):
        with_total_samples(data, 1 << 36)
    # The largest: the low 36 of the 64 bits at byte 18 (rate, channels and bits above them stay).
    field = with_total_samples(data, (1 << 36) - 1)[18:26]
    assert field[:3] == data[18:21] and field[3] == data[21] | 0x0F and field[4:] == b"\xff" * 4


# --- mulaw -------------------------------------------------------------------------------


def test_mulaw_tables_follow_g711() -> None:
    def code(sample: int) -> int:
        return int(ENCODE_TABLE[sample + 32_768])

    # The reference coder's fixed points: zero, the extremes, a segment edge.
    assert (code(0), code(-1), code(32_767), code(-32_768)) == (0xFF, 0x7E, 0x80, 0x00)  # -1 is -1 in 14 bits
    assert DECODE_TABLE[0xFF] == 0 and DECODE_TABLE[0x80] == 32_124 and DECODE_TABLE[0x00] == -32_124
    # Monotonic in the input, and every code is used.
    x = np.arange(-32_768, 32_768)
    decoded = DECODE_TABLE[ENCODE_TABLE[x + 32_768]].astype(np.int64)
    assert np.all(np.diff(decoded) >= 0) and len(set(ENCODE_TABLE.tolist())) == 256 - 1  # 0x7F/0xFF: ±0
    # The quantisation error: half a step of the segment (step 2^(seg+3)), plus 2 for the
    # 14-bit input, up to the clip level.
    segment = ((ENCODE_TABLE[x + 32_768] ^ 0xFF) >> 4 & 7).astype(np.int64)
    inside = np.abs(x) <= 32_124
    assert np.all((np.abs(decoded - x) <= (1 << (segment + 2)) + 3)[inside])


def test_mulaw_frames_are_20ms_bytes() -> None:
    audio = signal(24_000)
    enc = make_encoder("mulaw", 8_000)
    frames = encode(enc, audio, 4096)
    assert {len(f.payload) for f in frames[:-1]} == {160}
    assert all(len(f.payload) == f.samples for f in frames)
    pcm = from_mulaw(b"".join(f.payload for f in frames))
    reference = make_encoder("pcm16", 8_000)
    ref = np.frombuffer(b"".join(f.payload for f in encode(reference, audio, 4096)), "<i2")
    assert len(pcm) == len(ref) and snr_db(ref.astype(float), pcm.astype(float)) > 30
