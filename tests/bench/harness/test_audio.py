"""The harness counts an Opus packet's samples from its header as a decode would give them."""

from __future__ import annotations

import numpy as np
import opuslib
import pytest

from bench.harness.audio import make_decoder

#: (application, bitrate) that make libopus choose each of its modes on speech-like audio.
MODES = (
    (opuslib.APPLICATION_VOIP, 8_000),
    (opuslib.APPLICATION_VOIP, 20_000),
    (opuslib.APPLICATION_AUDIO, 96_000),
)


def family(packet: bytes) -> str:
    config = packet[0] >> 3
    return "silk" if config < 12 else "hybrid" if config < 16 else "celt"


@pytest.mark.parametrize("rate", [24_000, 48_000])
@pytest.mark.parametrize("frame_ms", [20, 40, 60])
def test_an_opus_packet_s_count_equals_its_decoded_samples(rate: int, frame_ms: int) -> None:
    n = rate * frame_ms // 1000
    t = np.arange(n * 20) / rate
    voice = 0.3 * np.sin(2 * np.pi * 180 * t) * (np.sin(2 * np.pi * 2 * t) > 0)  # with pauses
    noise = np.random.default_rng(0).standard_normal(t.size) * np.linspace(0, 0.3, t.size)
    pcm = ((voice + noise).clip(-1, 1) * 32767).astype(np.int16)
    seen = set()
    for application, bitrate in MODES:
        encoder = opuslib.Encoder(rate, 1, application)
        encoder.bitrate = bitrate
        decoder = make_decoder("opus", rate, frame_ms)
        for start in range(0, pcm.size, n):
            packet = encoder.encode(pcm[start : start + n].tobytes(), n)
            seen.add(family(packet))
            assert decoder.count(packet) == decoder.decode(packet).size == n
    assert decoder.count(b"") == decoder.decode(b"").size == 0
    assert seen == {"silk", "hybrid", "celt"}  # every branch of the header's table was read


def test_a_pcm16_payload_s_count_equals_its_samples() -> None:
    decoder = make_decoder("pcm16", 24_000)
    payload = np.arange(480, dtype="<i2").tobytes()
    assert decoder.count(payload) == decoder.decode(payload).size == 480
