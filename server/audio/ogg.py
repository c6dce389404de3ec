"""The ``ogg`` wire format: a live Ogg Opus stream (RFC 7845 over RFC 3533), page by page.

No maintained Python package writes Ogg Opus packet by packet, so this is a
small page writer over :class:`~server.audio.opus.OpusStreamEncoder` packets:

* Page 0: the OpusHead packet alone (beginning-of-stream flag, granule 0),
  with the encoder's pre-skip in 48 kHz units and the output rate as the
  "input sample rate" field. Page 1: OpusTags (vendor = the libopus version).
  Both travel at the start of the first wire frame's payload, together with
  the first audio page, so concatenating the payloads gives a valid .opus
  file and the first frame alone is decodable.
* Audio pages: whole packets only (a packet never spans pages, so every page
  is independently useful to a live reader). The granule position is the
  end of the page's last packet in 48 kHz units *including* the pre-skip,
  i.e. ``960 · packets so far`` (RFC 7845 §4).
* The last page has the end-of-stream flag and the granule
  ``pre-skip + N · 48000 / rate``, smaller than its packets' natural end:
  this is RFC 7845 end trimming, and it removes exactly the zero padding
  the Opus encoder appended, so a decoder returns exactly ``N`` samples.

Flushing: a page is closed as soon as it holds ``page_ms`` of audio, and any
partial page is closed at the end of every :meth:`OggOpusEncoder.push`, so
encoded audio is never held back waiting for more input (live playback wins
over the ~28 bytes of one extra page header per push). One wire frame carries
one page; its ``samples`` are the stream samples the page's packets carry
(the same accounting as the ``opus`` format), so they sum to ``N`` and the
``sample`` header is the page's first audible sample on the stream timeline.
"""

from __future__ import annotations

import secrets
import struct

from server.audio.base import EncodedFrame
from server.audio.opus import (
    DEFAULT_BITRATE,
    DEFAULT_COMPLEXITY,
    FRAME_MS,
    OpusPacket,
    OpusStreamEncoder,
    libopus_version,
)
from server.engine_api import AudioArray

#: Default longest audio per Ogg page, in ms (5 packets): a small page-header
#: overhead (~8% at 32 kbit/s) while bounding what a page holds back.
DEFAULT_PAGE_MS = 100
_FLAG_BOS = 0x02
_FLAG_EOS = 0x04
_MAX_SEGMENTS = 255
_GRANULE_PER_PACKET = 48_000 * FRAME_MS // 1000  # 960: granules count 48 kHz samples


def _crc_table() -> tuple[int, ...]:
    # Ogg's CRC-32: polynomial 0x04C11DB7, MSB first, init 0, no final xor
    # (not zlib's reflected CRC-32, so zlib.crc32 cannot be used).
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else (r << 1)
        table.append(r & 0xFFFFFFFF)
    return tuple(table)


_CRC_TABLE = _crc_table()


def ogg_crc(data: bytes) -> int:
    """The Ogg page checksum of ``data`` (the page with its CRC field zeroed)."""
    crc = 0
    table = _CRC_TABLE
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[(crc >> 24) ^ byte]
    return crc


def _lacing(size: int) -> bytes:
    # A packet is a run of 255-byte segments ended by one shorter (maybe 0) segment.
    return b"\xff" * (size // 255) + bytes((size % 255,))


def ogg_page(packets: list[bytes], *, granule: int, serial: int, sequence: int, flags: int = 0) -> bytes:
    """Build one Ogg page holding whole ``packets``.

    Raises:
        ValueError: the packets need more than 255 lacing segments.
    """
    table = b"".join(_lacing(len(p)) for p in packets)
    if len(table) > _MAX_SEGMENTS:
        raise ValueError("packets do not fit in one Ogg page")
    header = struct.pack(
        "<4sBBqIIIB", b"OggS", 0, flags, granule, serial & 0xFFFFFFFF, sequence, 0, len(table)
    )
    page = bytearray(header + table + b"".join(packets))
    struct.pack_into("<I", page, 22, ogg_crc(bytes(page)))
    return bytes(page)


def opus_head(*, preskip_48k: int, input_rate: int, channels: int = 1) -> bytes:
    """The OpusHead identification packet (RFC 7845 §5.1), channel mapping family 0."""
    return struct.pack("<8sBBHIhB", b"OpusHead", 1, channels, preskip_48k, input_rate, 0, 0)


def opus_tags(vendor: str, comments: tuple[str, ...] = ()) -> bytes:
    """The OpusTags comment packet (RFC 7845 §5.2)."""
    out = [b"OpusTags", struct.pack("<I", len(vendor.encode())), vendor.encode()]
    out.append(struct.pack("<I", len(comments)))
    for comment in comments:
        raw = comment.encode("utf-8")
        out += [struct.pack("<I", len(raw)), raw]
    return b"".join(out)


class OggOpusEncoder:
    """A :class:`~server.audio.base.FrameEncoder` producing an Ogg Opus stream, one page per frame."""

    def __init__(
        self,
        sample_rate: int,
        *,
        bitrate: int = DEFAULT_BITRATE,
        complexity: int = DEFAULT_COMPLEXITY,
        page_ms: int = DEFAULT_PAGE_MS,
        serial: int | None = None,
    ) -> None:
        """Create the encoder and its page writer.

        Args:
            sample_rate: the Opus encoding rate (see :data:`server.audio.opus.OPUS_RATES`).
            bitrate: Opus target bitrate in bit/s.
            complexity: libopus complexity 0..10.
            page_ms: close a page once it holds this much audio (rounded up to
                whole 20 ms packets); partial pages are also closed at the end
                of every push.
            serial: the Ogg stream serial number; random when ``None`` (RFC
                3533 wants serials unique within a physical stream; pass a
                fixed one for byte-reproducible output).

        Raises:
            ValueError: bad rate, bitrate, complexity or ``page_ms < 20``.
        """
        if page_ms < FRAME_MS:
            raise ValueError(f"ogg page_ms must be at least {FRAME_MS}, got {page_ms}")
        self.stream = OpusStreamEncoder(sample_rate, bitrate=bitrate, complexity=complexity)
        self.page_packets = -(-page_ms // FRAME_MS)
        self.serial = secrets.randbits(32) if serial is None else serial & 0xFFFFFFFF
        self._sequence = 0
        self._granule = 0
        self._headers: bytes | None = self._header_pages()

    @property
    def format(self) -> str:
        """``ogg``."""
        return "ogg"

    @property
    def sample_rate(self) -> int:
        """The encoding (and output) rate."""
        return self.stream.sample_rate

    def _page(self, packets: list[bytes], granule: int, flags: int = 0) -> bytes:
        page = ogg_page(packets, granule=granule, serial=self.serial, sequence=self._sequence, flags=flags)
        self._sequence += 1
        return page

    def _header_pages(self) -> bytes:
        head = opus_head(preskip_48k=self.stream.preskip_48k, input_rate=self.stream.sample_rate)
        tags = opus_tags(libopus_version(), ("ENCODER=chattts-stream",))
        return self._page([head], 0, _FLAG_BOS) + self._page([tags], 0)

    def _paginate(self, packets: list[OpusPacket], *, final: bool) -> list[EncodedFrame]:
        groups: list[list[OpusPacket]] = [[]]
        segments = 0
        for packet in packets:
            need = len(packet.data) // 255 + 1
            if groups[-1] and (len(groups[-1]) >= self.page_packets or segments + need > _MAX_SEGMENTS):
                groups.append([])
                segments = 0
            groups[-1].append(packet)
            segments += need
        frames: list[EncodedFrame] = []
        for i, group in enumerate(groups):
            if not group:
                continue
            self._granule += _GRANULE_PER_PACKET * len(group)
            granule, flags = self._granule, 0
            if final and i == len(groups) - 1:
                # End trimming: the decoder stops at exactly N samples (RFC 7845 §4.5).
                flags = _FLAG_EOS
                scale = 48_000 // self.stream.sample_rate
                granule = self.stream.preskip_48k + self.stream.input_samples * scale
            payload = self._page([p.data for p in group], granule, flags)
            if self._headers is not None:
                payload, self._headers = self._headers + payload, None
            frames.append(EncodedFrame(payload, sum(p.samples for p in group)))
        return frames

    def push(self, audio: AudioArray) -> list[EncodedFrame]:
        """Encode ``audio`` (at the output rate); one frame per page closed now (none if no packet)."""
        return self._paginate(self.stream.push(audio), final=False)

    def finish(self) -> list[EncodedFrame]:
        """Flush the encoder; the last frame holds the end-of-stream page (never empty)."""
        return self._paginate(self.stream.finish(), final=True)
