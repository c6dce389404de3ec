"""Voices made from reference recordings: the bounded folder they live in, and the catalogue.

A voice is a recording's codes (made by the engine on the inference thread) and its
transcript, with an id the client speaks with (``voice: "voice_…"``). :class:`VoiceStore`
keeps one JSON file per voice in ``--voices-dir``:

* **bounded** by ``--voices-max`` files and ``--voices-max-bytes`` bytes (files the server
  skipped count too: the bound is the folder's); an upload that would pass either is
  refused (``LimitReached``), nothing is evicted: a voice someone speaks with never vanishes;
* **atomic**: a file is written under a temporary name in the folder, flushed, and renamed
  into place, so a crash or a full disk never leaves a half-written voice (temporary files
  left by a crash are removed at start-up);
* **tied to the weights**: each file names the encoder that made its codes
  (``EngineInfo.voice_encoder``, the DVAE's sha256); at start-up, voices made by another
  encoder are skipped with one log line each (kept on disk, not listed, not spoken).

:class:`VoiceLibrary` is the event loop's view: it decodes uploads off the loop
(:mod:`server.voices.recording`), has the engine make the codes (``EngineClient.encode_voice``),
stores them (in a worker thread) and resolves ids for the service. A stream carries its
voice (``SynthesisParams.reference``), so deleting a voice never changes a running stream.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from server.config import Settings
from server.core.client import EngineClient
from server.engine.weights.locate import cache_root
from server.engine_api import VoiceSample
from server.errors import InvalidRequest, LimitReached, NotFound, Overloaded, ServiceError, Unsupported
from server.text.segments import has_speakable
from server.text.tags import problem as tag_problem
from server.voices.recording import (
    MAX_REFERENCE_S,
    REFERENCE_RATE,
    ReferenceAudioError,
    decode_recording,
    transcript_limit,
)

log = logging.getLogger(__name__)

FORMAT: Final = "chattts-stream voice 1"
VOICE_ID: Final = re.compile(r"voice_[0-9a-f]{16}")
#: Uploads decoded and encoded at once; more are answered ``overloaded`` (each holds its upload).
MAX_UPLOADS_IN_FLIGHT: Final = 2
MAX_NAME_CHARS: Final = 256


class StorageFailed(ServiceError):
    """The voices folder could not be written (a full disk, permissions)."""


@dataclass(frozen=True, kw_only=True)
class StoredVoice:
    """One voice from a recording, as stored and listed.

    Attributes:
        id: what clients pass as ``voice``.
        name: the client's label for it.
        created_at: Unix time, seconds.
        seconds: the recording's length.
        encoder: what made the codes (``EngineInfo.voice_encoder``).
        sample: the codes and transcript every stream in this voice carries.
        owner: the tenant that made it (API keys); None: made without keys, everyone's.
    """

    id: str
    name: str
    created_at: int
    seconds: float
    encoder: str
    sample: VoiceSample
    owner: str | None = None

    def visible_to(self, owner: str | None) -> bool:
        """Whether ``owner`` (None: no tenants, one user) may list, speak and delete it."""
        return self.owner is None or owner is None or self.owner == owner

    def describe(self) -> dict[str, Any]:
        """The voice as the HTTP API shows it (OpenAI's ``audio.voice`` object plus ours)."""
        return {
            "id": self.id,
            "object": "audio.voice",
            "type": "audio_sample",
            "name": self.name,
            "created_at": self.created_at,
            "seconds": round(self.seconds, 3),
            "transcript": self.sample.transcript,
        }

    def to_bytes(self) -> bytes:
        """The file's content."""
        codes = np.ascontiguousarray(self.sample.codes, "<u2")
        data = {
            "format": FORMAT,
            "id": self.id,
            "name": self.name,
            "created_at": self.created_at,
            "seconds": self.seconds,
            "encoder": self.encoder,
            "owner": self.owner,
            "transcript": self.sample.transcript,
            "codes": {"shape": list(codes.shape), "data": base64.b64encode(codes.tobytes()).decode()},
        }
        return (json.dumps(data, ensure_ascii=False, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> StoredVoice:
        """Parse a file (``ValueError``, ``KeyError`` or ``TypeError`` when it is not one)."""
        data = json.loads(raw)
        if data.get("format") != FORMAT or not VOICE_ID.fullmatch(data["id"]):
            raise ValueError("not a voice file of this format")
        shape = tuple(int(n) for n in data["codes"]["shape"])
        codes = np.frombuffer(base64.b64decode(data["codes"]["data"]), "<u2").reshape(shape).astype(np.uint16)
        return cls(
            id=data["id"],
            name=str(data["name"]),
            created_at=int(data["created_at"]),
            seconds=float(data["seconds"]),
            encoder=str(data["encoder"]),
            sample=VoiceSample(codes=codes, transcript=str(data["transcript"])),
            owner=None if data.get("owner") is None else str(data["owner"]),
        )


class VoiceStore:
    """One JSON file per voice in ``folder``, within a count and a byte bound (blocking I/O).

    Not thread-safe: one caller at a time (the library serializes them).
    """

    def __init__(self, folder: Path, *, max_count: int, max_bytes: int) -> None:
        self.folder = folder
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._sizes: dict[str, int] = {}  # every voice file in the folder → its bytes

    @property
    def count(self) -> int:
        """Voice files in the folder (skipped ones included)."""
        return len(self._sizes)

    @property
    def bytes(self) -> int:
        """Their bytes."""
        return sum(self._sizes.values())

    def load(self, encoder: str) -> list[StoredVoice]:
        """Every voice made by ``encoder``; others are skipped with a log line, stale temporaries removed."""
        self._sizes.clear()
        if not self.folder.is_dir():
            return []
        voices = []
        for path in sorted(self.folder.iterdir()):
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write that never finished (the process died)
                continue
            if not (path.suffix == ".json" and VOICE_ID.fullmatch(path.stem)):
                continue
            raw = path.read_bytes()
            self._sizes[path.stem] = len(raw)
            try:
                voice = StoredVoice.from_bytes(raw)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("voice file %s skipped: unreadable (%s)", path, exc)
                continue
            if voice.encoder != encoder:
                log.warning(
                    "voice %s skipped: made by other weights (%s, loaded %s); kept in %s",
                    voice.id,
                    voice.encoder,
                    encoder,
                    self.folder,
                )
                continue
            voices.append(voice)
        return sorted(voices, key=lambda v: (v.created_at, v.id))

    def check_room(self, size: int) -> None:
        """Raise ``LimitReached`` when a new file of ``size`` bytes would pass a bound."""
        full = None
        if self.count + 1 > self.max_count:
            full = f"the server holds {self.count} voices, its limit (--voices-max {self.max_count})"
        elif self.bytes + size > self.max_bytes:
            full = f"the voices folder would pass {self.max_bytes} bytes (--voices-max-bytes)"
        if full is not None:
            raise LimitReached(f"{full}; delete a voice first (DELETE /v1/audio/voices/{{id}})")

    def save(self, voice: StoredVoice) -> None:
        """Write ``voice`` atomically.

        Raises:
            LimitReached: it would pass a bound (nothing written).
            OSError: the write failed (nothing left behind).
        """
        raw = voice.to_bytes()
        self.check_room(len(raw))
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"{voice.id}.json"
        temp = self.folder / f".{voice.id}.{secrets.token_hex(4)}.tmp"
        try:
            with temp.open("wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            temp.replace(final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _sync_folder(self.folder)
        self._sizes[voice.id] = len(raw)

    def remove(self, voice_id: str) -> None:
        """Delete a voice's file (no-op when absent)."""
        (self.folder / f"{voice_id}.json").unlink(missing_ok=True)
        self._sizes.pop(voice_id, None)
        _sync_folder(self.folder)


def _sync_folder(folder: Path) -> None:
    """Make a rename or unlink durable (POSIX: fsync the directory)."""
    if not folder.is_dir():
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def settings_problem(settings: Settings) -> str | None:
    """Why the voice settings cannot work, or ``None``."""
    if not 0 <= settings.voice_max_seconds <= MAX_REFERENCE_S:
        seconds = settings.voice_max_seconds
        return f"--voice-max-seconds {seconds:g}: must be within 0 (off) and {MAX_REFERENCE_S:g}"
    if settings.voices_max < 0 or settings.voices_max_bytes < 0 or settings.voice_upload_max_bytes < 0:
        return "--voices-max, --voices-max-bytes and --voice-upload-max-bytes must not be negative"
    return None


class VoiceLibrary:
    """The voices from recordings this server speaks, by id (event loop side)."""

    def __init__(self, settings: Settings, engine: EngineClient) -> None:
        folder = (
            Path(settings.voices_dir).expanduser() if settings.voices_dir else cache_root(settings) / "voices"
        )
        self.store = VoiceStore(folder, max_count=settings.voices_max, max_bytes=settings.voices_max_bytes)
        self.max_seconds = settings.voice_max_seconds
        self.transcript_chars = transcript_limit(settings.voice_max_seconds)
        self._engine = engine
        self._encoder: str | None = None
        self._voices: dict[str, StoredVoice] = {}
        self._lock = asyncio.Lock()  # one store write or removal at a time
        self._uploads = 0

    async def load(self, encoder: str | None) -> None:
        """Read the folder (start-up): the voices ``encoder`` made become speakable."""
        self._encoder = encoder
        if encoder is None or self.max_seconds <= 0:
            return
        async with self._lock:
            voices = await asyncio.to_thread(self.store.load, encoder)
        self._voices = {v.id: v for v in voices}
        if voices:
            log.info("%d voices from recordings loaded from %s", len(voices), self.store.folder)

    def get(self, voice_id: str, owner: str | None = None) -> StoredVoice | None:
        """The voice named ``voice_id`` if ``owner`` sees it (another tenant's is none), or ``None``."""
        voice = self._voices.get(voice_id)
        return voice if voice is not None and voice.visible_to(owner) else None

    def all(self, owner: str | None = None) -> list[StoredVoice]:
        """Every voice ``owner`` sees (None: every voice), oldest first."""
        return [voice for voice in self._voices.values() if voice.visible_to(owner)]

    async def create(
        self, data: bytes, transcript: str, name: str = "", owner: str | None = None
    ) -> StoredVoice:
        """A new voice from an uploaded recording and its transcript, owned by ``owner``.

        Raises:
            InvalidRequest: the recording or transcript cannot make a voice (the message says why).
            Unsupported: voices from recordings are off here.
            LimitReached: the folder is full.
            Overloaded: too many uploads at once.
            StorageFailed, EngineFailed, EngineUnavailable: the server could not do it.
        """
        if self._encoder is None or self.max_seconds <= 0:
            raise Unsupported("voices from recordings are off on this server (--voice-max-seconds 0)")
        transcript = self._check_transcript(transcript)
        if len(name) > MAX_NAME_CHARS:
            raise InvalidRequest(f"name has {len(name)} characters; at most {MAX_NAME_CHARS}")
        self.store.check_room(0)
        if self._uploads >= MAX_UPLOADS_IN_FLIGHT:
            raise Overloaded("other recordings are being processed; retry shortly", retry_after_ms=1000)
        self._uploads += 1
        try:
            return await self._create(data, transcript, name, owner)
        finally:
            self._uploads -= 1

    async def _create(self, data: bytes, transcript: str, name: str, owner: str | None) -> StoredVoice:
        assert self._encoder is not None
        try:
            audio = await asyncio.to_thread(decode_recording, data, max_seconds=self.max_seconds)
        except ReferenceAudioError as exc:
            raise InvalidRequest(str(exc)) from None
        codes = await self._engine.encode_voice(audio, transcript)
        voice = StoredVoice(
            id=f"voice_{secrets.token_hex(8)}",
            name=name,
            created_at=int(time.time()),
            seconds=len(audio) / REFERENCE_RATE,
            encoder=self._encoder,
            sample=VoiceSample(codes=codes, transcript=transcript),
            owner=owner,
        )
        async with self._lock:
            try:
                await asyncio.to_thread(self.store.save, voice)
            except OSError as exc:
                log.error("storing voice %s in %s failed: %s", voice.id, self.store.folder, exc)
                raise StorageFailed(f"the voice could not be stored: {exc.strerror or 'I/O error'}") from None
            self._voices[voice.id] = voice
        log.info("voice %s made from a %.1f s recording", voice.id, voice.seconds)
        return voice

    def _check_transcript(self, transcript: str) -> str:
        text = transcript.strip()
        if not text:
            raise InvalidRequest("transcript is empty: send what is said in the recording")
        if len(text) > self.transcript_chars:
            raise InvalidRequest(
                f"transcript has {len(text)} characters; at most {self.transcript_chars} "
                f"for recordings of up to {self.max_seconds:g} s"
            )
        if (problem := tag_problem(text)) is not None:
            raise InvalidRequest(f"transcript: {problem}")
        if not has_speakable(text):
            raise InvalidRequest("transcript has nothing to speak")
        return text

    async def delete(self, voice_id: str, owner: str | None = None) -> StoredVoice:
        """Delete a voice ``owner`` sees; streams already speaking with it go on (they carry it).

        Raises:
            NotFound: no such voice here (or only another tenant's).
            StorageFailed: its file could not be removed (the voice stays).
        """
        async with self._lock:
            voice = self.get(voice_id, owner)
            if voice is None:
                raise NotFound(f"no voice {voice_id!r} here")
            try:
                await asyncio.to_thread(self.store.remove, voice_id)
            except OSError as exc:
                raise StorageFailed(
                    f"the voice could not be deleted: {exc.strerror or 'I/O error'}"
                ) from None
            del self._voices[voice_id]
        return voice
