"""Voices from recordings over HTTP: ``POST /v1/audio/voices`` and ``DELETE /v1/audio/voices/{id}``.

The upload is OpenAI's custom-voice request (``client.audio.voices.create``): a
``multipart/form-data`` body with the recording as ``audio_sample`` (a file: WAV, Ogg, FLAC,
MP3), a ``name``, and, ours, its ``transcript`` (what is said in it; ChatTTS conditions on
it). ``consent`` is accepted and ignored; ``type`` other than ``audio_sample`` is refused.
``curl -F audio_sample=@me.wav -F transcript="…" -F name=me`` does it too. The answer is
OpenAI's ``audio.voice`` object; its ``id`` is a ``voice`` for ``start`` and
``/v1/audio/speech``. Behind the same access gate (middleware) and per-client rate limit as
speech; decoding runs in a worker thread, the codes on the inference thread
(:class:`server.voices.library.VoiceLibrary`).
"""

from __future__ import annotations

import binascii
from typing import Final

from aiohttp import BodyPartReader, web

from server.config import Settings
from server.errors import InvalidRequest, ServiceError
from server.frontends.access import tenant_of
from server.frontends.http.common import CLIENT, body_refused, counted_error, service_error
from server.frontends.http.transfer import BodyRefused, body_deadline
from server.metrics import Metrics
from server.streams.service import SpeechService
from server.voices.library import MAX_NAME_CHARS

#: Form fields that carry the recording (OpenAI's name first).
AUDIO_FIELDS: Final = ("audio_sample", "audio", "file")
#: Text fields read (others are skipped); each at most this many bytes.
TEXT_FIELDS: Final = ("transcript", "name", "type", "consent")
MAX_TEXT_BYTES: Final = 16 * 1024


class _TooLarge(Exception):
    """The upload is over ``--voice-upload-max-bytes``."""


class _BadPart(InvalidRequest):
    """A part of the form that cannot be read (its charset, its transfer encoding), by its name."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(f"{part}: {message}")
        self.part = part


class VoicesApi:
    """The voice routes, on the HTTP API's aiohttp application."""

    def __init__(self, service: SpeechService, settings: Settings, metrics: Metrics) -> None:
        self.service = service
        self.settings = settings
        self.metrics = metrics

    def add_routes(self, app: web.Application) -> None:
        """Register the routes (the listing stays with the other discovery routes)."""
        app.router.add_post("/v1/audio/voices", self.create)
        app.router.add_delete("/v1/audio/voices/{voice_id}", self.delete)

    async def create(self, request: web.Request) -> web.Response:
        """``POST /v1/audio/voices``: a new voice from a recording and its transcript."""
        limit = self.settings.voice_upload_max_bytes
        try:
            self.service.admit(request[CLIENT])
            if request.content_length is not None and request.content_length > limit + MAX_TEXT_BYTES:
                raise _TooLarge
            async with body_deadline(self.settings.body_timeout_s):
                fields, audio = await _read_form(request, limit)
            if fields.get("type", "audio_sample") != "audio_sample":
                message = "only voices from a recording (type audio_sample) can be made here"
                return counted_error(self.metrics, 400, "unsupported", message, param="type")
            if audio is None:
                return counted_error(
                    self.metrics,
                    400,
                    "bad_request",
                    "missing the recording (audio_sample)",
                    param="audio_sample",
                )
            if "transcript" not in fields:
                message = "missing the transcript: what is said in the recording"
                return counted_error(self.metrics, 400, "bad_request", message, param="transcript")
            if len(name := fields.get("name", "")) > MAX_NAME_CHARS:
                message = f"name has {len(name)} characters; at most {MAX_NAME_CHARS}"
                return counted_error(self.metrics, 400, "bad_request", message, param="name")
            owner = tenant_of(request[CLIENT])
            voice = await self.service.voices.create(
                audio, fields["transcript"], fields.get("name", ""), owner
            )
        except _TooLarge:
            message = f"the upload is over {limit} bytes (--voice-upload-max-bytes)"
            return counted_error(self.metrics, 413, "bad_request", message, param="audio_sample")
        except BodyRefused as refused:
            return body_refused(self.metrics, refused)
        except _BadPart as exc:
            return service_error(exc, self.metrics, param=exc.part)
        except InvalidRequest as exc:
            # The engine's refusals say "the transcript ...", the library's "transcript ...".
            param = (
                "transcript" if exc.message.removeprefix("the ").startswith("transcript") else "audio_sample"
            )
            return service_error(exc, self.metrics, param=param)
        except ServiceError as exc:
            return service_error(exc, self.metrics)
        return web.json_response(voice.describe())

    async def delete(self, request: web.Request) -> web.Response:
        """``DELETE /v1/audio/voices/{id}``: remove a voice (streams already using it go on)."""
        voice_id = request.match_info["voice_id"]
        try:
            self.service.check_rate(request[CLIENT])
            await self.service.voices.delete(voice_id, tenant_of(request[CLIENT]))
        except ServiceError as exc:
            return service_error(exc, self.metrics)
        return web.json_response({"id": voice_id, "object": "audio.voice.deleted", "deleted": True})


async def _read_form(request: web.Request, limit: int) -> tuple[dict[str, str], bytes | None]:
    """The text fields and the recording of a multipart body, each read within its bound.

    Raises:
        InvalidRequest: not ``multipart/form-data``, or malformed.
        _TooLarge: the recording is over ``limit`` bytes.
    """
    if request.content_type == "application/x-www-form-urlencoded":  # a form without a file (bounded)
        posted = await request.post()
        return {k: v for k, v in posted.items() if k in TEXT_FIELDS and isinstance(v, str)}, None
    if request.content_type != "multipart/form-data":
        raise InvalidRequest(
            f"send multipart/form-data (audio_sample=@file, transcript=...), not {request.content_type}"
        )
    fields: dict[str, str] = {}
    audio: bytes | None = None
    try:
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader):
                continue  # a nested multipart: not ours
            if part.name in AUDIO_FIELDS and audio is None:
                audio = await _read_capped(part, limit, _TooLarge)
            elif part.name in TEXT_FIELDS:
                too_long = _BadPart(part.name, f"too long: at most {MAX_TEXT_BYTES} bytes")
                raw = await _read_capped(part, MAX_TEXT_BYTES, too_long)
                fields[part.name] = _text(part, raw)
    except (ValueError, AssertionError) as exc:
        raise InvalidRequest(f"malformed multipart body: {exc}") from None
    return fields, audio


def _text(part: BodyPartReader, raw: bytes) -> str:
    """A text part in its charset (UTF-8 when it names none).

    Raises:
        _BadPart: an unknown charset, or bytes that are not in it.
    """
    name = part.name or "?"
    charset = part.get_charset("utf-8")
    try:
        return raw.decode(charset)
    except LookupError:  # no such codec, or one that is no text encoding (base64, rot13)
        raise _BadPart(name, f"unknown charset {charset!r}") from None
    except UnicodeDecodeError:
        raise _BadPart(name, f"the text is not valid {charset}") from None


async def _read_capped(part: BodyPartReader, limit: int, over: Exception | type[Exception]) -> bytes:
    """A part's body, decoded from its transfer encoding, raising ``over`` past ``limit`` bytes.

    Raises:
        _BadPart: an unknown or malformed Content-Transfer-Encoding.
    """
    data = bytearray()
    while chunk := await part.read_chunk(64 * 1024):
        data += chunk
        if len(data) > limit:
            raise over
    try:
        return bytes(part.decode(bytes(data)))
    except RuntimeError as exc:  # aiohttp's "unknown content transfer encoding: x"
        raise _BadPart(part.name or "?", str(exc)) from None
    except binascii.Error as exc:
        encoding = part.headers.get("Content-Transfer-Encoding", "")
        raise _BadPart(part.name or "?", f"malformed {encoding}: {exc}") from None
