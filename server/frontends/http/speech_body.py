"""What the body of OpenAI's ``POST /v1/audio/speech`` means here: parsed, checked, made a request.

OpenAI's fields (``input``, ``model``, ``voice``, ``response_format``, ``speed``,
``instructions``, ``stream_format``) and ours (``seed``, ``temperature``, ``top_p``, ``top_k``,
``sample_rate``, ``refine``, ``refine_prompt``, ``stream``) become a
:class:`~server.streams.request.SpeechRequest`; a problem becomes a :class:`BodyError` naming
the field (OpenAI's ``param``). Pure values: no sockets.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from server.frontends import messages
from server.frontends.common import RefinePrompt, Seed, Temperature, TopK, TopP
from server.frontends.messages import BadMessage
from server.streams.request import SpeechRequest

#: OpenAI ``response_format`` → (our format, default rate, Content-Type). OpenAI's ``opus`` is Ogg Opus.
FORMATS: Final = {
    "pcm": ("pcm16", 24_000, "audio/pcm"),
    "wav": ("pcm16", 24_000, "audio/wav"),
    "opus": ("ogg", 24_000, "audio/ogg; codecs=opus"),
    "mp3": ("mp3", 24_000, "audio/mpeg"),
    "flac": ("flac", 24_000, "audio/flac"),
    # Not OpenAI's: G.711 μ-law for telephony; audio/basic is 8 kHz mono μ-law (RFC 2046).
    "mulaw": ("mulaw", 8_000, "audio/basic"),
}
#: Formats answered with the complete file unless ``stream`` is true: a streamed FLAC cannot say
#: its length, and libsndfile (``soundfile``, how most Python code reads audio) cannot open a
#: FLAC file without it. Every other format's live stream is a file its readers open as it is.
COMPLETE_BY_DEFAULT: Final = frozenset({"flac"})
#: OpenAI's default. (``aac`` is not produced: see docs/protocol.md, Formats.)
DEFAULT_FORMAT: Final = "mp3"
#: Model names accepted (any string is; these are advertised). All are the same ChatTTS model.
MODELS: Final = ("chattts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
#: OpenAI's speed range; values inside it are clamped to ours (0.5–2.0).
OPENAI_SPEED: Final = (0.25, 4.0)
OUR_SPEED: Final = (0.5, 2.0)


class VoiceRef(msgspec.Struct, forbid_unknown_fields=False):
    """OpenAI's custom-voice object form, ``{"id": "..."}``."""

    id: str


class SpeechBody(msgspec.Struct, forbid_unknown_fields=False):
    """The body of ``POST /v1/audio/speech``; unknown fields are ignored."""

    input: str
    model: str = "chattts"
    voice: str | VoiceRef = "alloy"
    response_format: str = DEFAULT_FORMAT
    speed: float = 1.0
    instructions: str | None = None  # accepted; ChatTTS has no instruction control
    stream_format: str = "audio"
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    sample_rate: int | None = None  # extension: 16000, 24000 or 48000
    refine: bool = False  # extension: ChatTTS's refinement pass first
    refine_prompt: RefinePrompt = ""  # extension: its controls, "[oral_2][laugh_0][break_6]"
    # extension: true, the audio as it is made; false, the complete file with its length;
    # absent, the format's way (complete for COMPLETE_BY_DEFAULT, live for the others).
    stream: bool | None = None

    @property
    def live(self) -> bool:
        """Send the audio as it is made (else the complete file once the stream has ended)."""
        return self.response_format not in COMPLETE_BY_DEFAULT if self.stream is None else self.stream


_decoder: Final = msgspec.json.Decoder(SpeechBody)
_PARAM = re.compile(r"\$\.(\w+)|field `(\w+)`")


def _param_of(text: str) -> str | None:
    match = _PARAM.search(text)
    return (match.group(1) or match.group(2)) if match else None


class BodyError(Exception):
    """A request body problem, naming the offending field (OpenAI's ``param``)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def parse_body(raw: bytes, max_depth: int) -> SpeechBody:
    """The body, decoded (the HTTP API's one JSON decoding path) and checked.

    Raises:
        BodyError: naming the problem, and the field when there is one.
    """
    try:
        body = messages.decode(raw, _decoder, max_depth=max_depth)
    except BadMessage as bad:
        if bad.validation is None:  # malformed, too deep, or a number out of range
            raise BodyError("bad_request", bad.message, bad.field) from None
        raise BodyError("bad_request", f"invalid body: {bad.validation}", _param_of(bad.validation)) from None
    fmt = body.response_format
    if fmt not in FORMATS:
        message = f"response_format {fmt!r} is not supported; use one of {list(FORMATS)}"
        raise BodyError("unsupported", message, "response_format")
    if body.stream_format != "audio":
        raise BodyError("unsupported", "only stream_format 'audio' is supported (no 'sse')", "stream_format")
    if not OPENAI_SPEED[0] <= body.speed <= OPENAI_SPEED[1]:
        low, high = OPENAI_SPEED
        raise BodyError("bad_request", f"speed must be within {low} and {high}", "speed")
    return body


def speech_request(body: SpeechBody) -> SpeechRequest:
    """The service's request for a checked body."""
    our_format, rate, _ = FORMATS[body.response_format]
    voice = body.voice.id if isinstance(body.voice, VoiceRef) else body.voice
    return SpeechRequest(
        name="http",
        text=body.input,
        voice=voice,  # the stream layer resolves it (OpenAI's names too), as for every port
        speed=min(OUR_SPEED[1], max(OUR_SPEED[0], body.speed)),
        format=our_format,
        sample_rate=body.sample_rate or rate,
        seed=body.seed,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        refine=body.refine,
        refine_prompt=body.refine_prompt,
    )
