"""A byte-bounded LRU cache of finished deterministic streams (requests with a ``seed``).

A hit replays the stored frames at once, without the model. The key covers
everything that changes the audio: the text as segmented, voice (and a recording
voice's content), speed, seed, sampling controls, refinement, output format and
rate, and the engine's identity.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from server.streams.items import Frame, OutItem
from server.streams.request import SpeechRequest


@dataclass(frozen=True)
class CachedStream:
    """A finished stream's items, as the session numbered them."""

    items: tuple[OutItem, ...]
    size: int


def cache_key(
    msg: SpeechRequest, segments: Sequence[str], engine_identity: str, voice_digest: str = ""
) -> str | None:
    """The cache key of a request, or None when its audio is not reproducible (no seed).

    ``voice_digest`` names the content of a voice from a recording (its id alone could be
    reused by another recording).
    """
    if msg.seed is None or msg.incremental:
        return None
    parts = [
        engine_identity,
        "\x1e".join(segments),
        msg.voice,
        repr(msg.speed),
        str(msg.seed),
        repr(msg.temperature),
        repr(msg.top_p),
        repr(msg.top_k),
        msg.format,
        str(msg.sample_rate),
        f"frame_ms={msg.frame_ms}",
        f"refine={msg.refine}:{msg.refine_prompt}",
        f"words={msg.word_timestamps}",
        voice_digest,
    ]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


class ResponseCache:
    """LRU by bytes; entries larger than a quarter of the budget are not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[str, CachedStream] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CachedStream | None:
        """The entry for ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, items: Sequence[OutItem]) -> None:
        """Store a finished stream, evicting the least recently used entries to fit."""
        size = sum((len(item.payload) if isinstance(item, Frame) else 0) + 64 for item in items)
        if size > self.max_bytes // 4 or key in self._entries:
            return
        self._entries[key] = CachedStream(tuple(items), size)
        self.size += size
        while self.size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.size -= evicted.size
