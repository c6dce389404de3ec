"""The ``ogg`` format: a valid, live Ogg Opus stream with exact end trimming (RFC 7845)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from server.audio import make_encoder
from server.audio.ogg import OggOpusEncoder, ogg_crc, ogg_page

sys.path.insert(0, str(Path(__file__).parent))
from audio_signals import decode_packets, fake_audio, run_encoder, snr_db

RATES = (16_000, 24_000, 48_000)
TOOLS_MISSING = shutil.which("opusinfo") is None or shutil.which("opusdec") is None
# Skip only on a developer machine without the tools; under CI (which installs
# opus-tools through scripts/setup.sh --dev) a missing tool fails the test instead.
needs_tools = pytest.mark.skipif(
    TOOLS_MISSING and not os.environ.get("CI"),
    reason="opusinfo/opusdec not installed (Debian package opus-tools)",
)


@dataclass
class Page:
    flags: int
    granule: int
    serial: int
    sequence: int
    packets: list[bytes]
    size: int


def parse_pages(data: bytes) -> list[Page]:
    """A strict independent Ogg reader: capture pattern, version, CRC, lacing (no continued packets)."""
    pages, pos = [], 0
    while pos < len(data):
        magic, version, flags, granule, serial, seq, crc, nseg = struct.unpack_from("<4sBBqIIIB", data, pos)
        assert magic == b"OggS" and version == 0
        lacing = data[pos + 27 : pos + 27 + nseg]
        size = 27 + nseg + sum(lacing)
        raw = bytearray(data[pos : pos + size])
        raw[22:26] = b"\0\0\0\0"
        assert ogg_crc(bytes(raw)) == crc, "bad page CRC"
        assert lacing and lacing[-1] < 255, "our pages hold whole packets only"
        body, packets, cur = pos + 27 + nseg, [], 0
        for lace in lacing:
            cur += lace
            if lace < 255:
                packets.append(data[body : body + cur])
                body, cur = body + cur, 0
        pages.append(Page(flags, granule, serial, seq, packets, size))
        pos += size
    assert pos == len(data)
    return pages


def encode(rate: int, audio: np.ndarray, **kwargs: object) -> list:
    return run_encoder(make_encoder("ogg", rate, **kwargs), audio, [5000, 700, 9000])


def test_crc_matches_reference_vector() -> None:
    # Ogg's CRC is the catalogue's CRC-32/CKSUM (poly 0x04C11DB7, init 0, MSB first;
    # check 0x765E7680) without its final inversion: 0x765E7680 ^ 0xFFFFFFFF.
    assert ogg_crc(b"123456789") == 0x89A1897F


@pytest.mark.parametrize("rate", RATES)
def test_stream_structure(rate: int) -> None:
    audio = fake_audio()
    frames = encode(rate, audio, ogg_serial=0xC0FFEE)
    n = round(len(audio) * rate / 24_000)
    assert sum(f.samples for f in frames) == n
    assert all(f.payload for f in frames)
    first = parse_pages(frames[0].payload)
    assert first[0].packets[0][:8] == b"OpusHead" and first[1].packets[0][:8] == b"OpusTags"
    pages = parse_pages(b"".join(f.payload for f in frames))
    # One page per frame after the two header pages (which ride in the first frame).
    assert len(pages) == len(frames) + 2
    assert [p.sequence for p in pages] == list(range(len(pages)))
    assert {p.serial for p in pages} == {0xC0FFEE}
    assert pages[0].flags == 0x02 and all(p.flags == 0 for p in pages[1:-1]) and pages[-1].flags == 0x04
    _, version, channels, preskip, input_rate, gain, family = struct.unpack("<8sBBHIhB", pages[0].packets[0])
    assert (version, channels, preskip, input_rate, gain, family) == (1, 1, 312, rate, 0, 0)
    audio_pages = pages[2:]
    assert all(1 <= len(p.packets) <= 5 for p in audio_pages)  # default page_ms = 100
    packets = 0
    for page in audio_pages[:-1]:
        packets += len(page.packets)
        assert page.granule == 960 * packets  # 48 kHz units, including the pre-skip
    packets += len(audio_pages[-1].packets)
    final = audio_pages[-1].granule
    assert final == 312 + n * 48_000 // rate  # end trimming to exactly n samples
    assert 960 * (packets - 1) < final <= 960 * packets  # trims less than one packet
    # The packets are the same as the ``opus`` format's for the same stream.
    opus = run_encoder(make_encoder("opus", rate), audio, [5000, 700, 9000])
    assert [f.payload for f in opus] == [pk for p in audio_pages for pk in p.packets]
    # Each frame's samples are its packets' samples.
    sizes = iter(len(p.packets) for p in audio_pages)
    counts = iter(f.samples for f in opus)
    assert [sum(next(counts) for _ in range(next(sizes))) for _ in frames] == [f.samples for f in frames]


def test_pages_flush_on_every_push_and_by_page_ms() -> None:
    encoder = OggOpusEncoder(24_000, page_ms=40, serial=1)
    assert encoder.push(np.zeros(479, np.float32)) == []  # no packet yet: nothing to send
    frames = encoder.push(np.zeros(1 + 480 * 4 + 100, np.float32))  # completes 5 packets
    pages = parse_pages(b"".join(f.payload for f in frames))
    assert [len(p.packets) for p in pages[2:]] == [2, 2, 1]  # the partial page is not held back
    assert [f.samples for f in frames] == [480 - 156 + 480, 960, 480]
    tail = encoder.finish()
    assert parse_pages(b"".join(f.payload for f in tail))[-1].flags == 0x04


def test_large_pages_respect_segment_limit() -> None:
    # 510 kbit/s packets need ~6 lacing values each; 2 s pages would need > 255.
    rng = np.random.default_rng(0)
    noise = (0.5 * rng.standard_normal(24_000 * 3)).astype(np.float32)
    frames = run_encoder(
        make_encoder("ogg", 24_000, opus_bitrate=510_000, ogg_page_ms=2000), noise, [len(noise)]
    )
    pages = parse_pages(b"".join(f.payload for f in frames))
    assert len(pages) > 4
    assert sum(len(p.packets) for p in pages[2:]) == -(-(len(noise) + 156) // 480)


def test_page_writer_rejects_overfull_page() -> None:
    with pytest.raises(ValueError):
        ogg_page([b"x" * 300] * 128, granule=0, serial=0, sequence=0)
    with pytest.raises(ValueError):
        OggOpusEncoder(24_000, page_ms=10)


def test_decoded_by_our_reader_and_libopus() -> None:
    audio = fake_audio()
    frames = encode(24_000, audio)
    pages = parse_pages(b"".join(f.payload for f in frames))
    packets = [pk for p in pages[2:] for pk in p.packets]
    decoded = decode_packets(packets, 48_000)  # decode at 48 kHz as browsers do
    n48 = pages[-1].granule - 312
    heard = decoded[312 : 312 + n48]
    assert n48 == 2 * len(audio)
    reference = np.frombuffer(
        b"".join(f.payload for f in run_encoder(make_encoder("f32", 48_000), audio)), "<f4"
    )
    assert snr_db(reference, heard) > 17.0  # same floor as test_audio_opus (measured ~21 dB)


def wav_samples(path: Path) -> np.ndarray:
    """Samples of a float32 mono WAV as written by opusdec (RIFF chunks walked by hand)."""
    data = path.read_bytes()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    pos = 12
    while pos < len(data):
        tag, size = struct.unpack_from("<4sI", data, pos)
        if tag == b"data":
            return np.frombuffer(data[pos + 8 : pos + 8 + size], "<f4")
        pos += 8 + size + (size & 1)
    raise AssertionError("no data chunk")


@needs_tools
@pytest.mark.parametrize(
    ("rate", "n"), [(16_000, None), (24_000, None), (48_000, None), (24_000, 0), (24_000, 1)]
)
def test_opusinfo_and_opusdec(tmp_path: Path, rate: int, n: int | None) -> None:
    assert not TOOLS_MISSING, "CI must install opus-tools (opusinfo, opusdec)"
    audio = fake_audio() if n is None else (0.1 * np.ones(n)).astype(np.float32)
    frames = encode(rate, audio)
    path = tmp_path / "stream.opus"
    path.write_bytes(b"".join(f.payload for f in frames))
    info = subprocess.run(["opusinfo", str(path)], capture_output=True, text=True, timeout=20)
    report = info.stdout + info.stderr
    assert info.returncode == 0, report
    assert "WARNING" not in report.upper() and "ERROR" not in report.upper(), report
    assert "Pre-skip: 312" in report
    expected = sum(f.samples for f in frames)
    assert expected == round(len(audio) * rate / 24_000)
    for out_rate in (rate, 48_000):
        wav = tmp_path / f"out{out_rate}.wav"
        dec = subprocess.run(
            ["opusdec", "--quiet", "--float", "--rate", str(out_rate), str(path), str(wav)],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert dec.returncode == 0, dec.stderr
        assert len(wav_samples(wav)) == expected * out_rate // rate
