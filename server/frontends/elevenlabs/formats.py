"""ElevenLabs' request vocabulary in ours: ``output_format``, voice ids, ``voice_settings``, errors.

Pure values, shared by the WebSocket and REST routes of the ElevenLabs front end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from server.errors import UnknownVoice
from server.frontends.messages import convert

#: What an absent ``output_format`` means here: MP3 at the model's rate (ElevenLabs' own
#: default, ``mp3_44100_128``, needs a rate this server does not make).
DEFAULT_OUTPUT_FORMAT: Final = "mp3_24000_48"
#: ElevenLabs' speed range on the WebSocket is 0.7–1.2 and on REST 0.25–4; ours is 0.5–2.0.
#: A speed within the widest is clamped to ours; one outside it is refused.
OUR_SPEED: Final = (0.5, 2.0)
ELEVENLABS_SPEED: Final = (0.25, 4.0)
#: ASCII digits, bounded (``\d`` alone takes other scripts' digits, and a 5000-digit rate
#: would make ``int`` refuse it with a ``ValueError``).
_FORMAT: Final = re.compile(r"(pcm|ulaw|alaw|mp3|opus|wav)_(\d{1,6})(?:_(\d{1,6}))?", re.ASCII)
#: ElevenLabs codec → (our format, the rates we make for it, Content-Type).
_CODECS: Final = {
    "pcm": ("pcm16", (8_000, 16_000, 24_000, 48_000), "audio/pcm"),
    "ulaw": ("mulaw", (8_000,), "audio/basic"),
    "mp3": ("mp3", (24_000,), "audio/mpeg"),
    "opus": ("ogg", (48_000,), "audio/ogg; codecs=opus"),
}
#: Every ``output_format`` this server makes (listed in refusals).
SUPPORTED: Final = tuple(
    f"{codec}_{rate}" + ("_48" if codec == "mp3" else "_64" if codec == "opus" else "")
    for codec, (_, rates, _) in _CODECS.items()
    for rate in rates
)


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """One ``output_format`` as this server makes it.

    Attributes:
        name: ElevenLabs' name (``pcm_24000``).
        format: our stream format (``pcm16``, ``mulaw``, ``mp3``, ``ogg``).
        sample_rate: the output rate.
        content_type: what a REST response says it is.
    """

    name: str
    format: str
    sample_rate: int
    content_type: str

    @property
    def is_pcm(self) -> bool:
        """16-bit samples, so that bytes count samples (two per sample)."""
        return self.format == "pcm16"


class ElevenLabsError(Exception):
    """A refusal in ElevenLabs' shape: HTTP ``status``, ``{"detail": {"status", "message"}}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def body(self) -> dict[str, Any]:
        """The JSON body ElevenLabs answers errors with."""
        return {"detail": {"status": self.code, "message": self.message}}


def output_format(name: str | None) -> OutputFormat:
    """Our format and rate for an ElevenLabs ``output_format`` (None: the default).

    The bitrate in an ``mp3_*``/``opus_*`` name is not used: the server's ``--mp3-bitrate``
    and ``--opus-bitrate`` are.

    Raises:
        ElevenLabsError: a format or rate this server does not make (400, listing those it does).
    """
    name = name or DEFAULT_OUTPUT_FORMAT
    match = _FORMAT.fullmatch(name)
    codec = _CODECS.get(match.group(1)) if match else None
    if match is None or codec is None or int(match.group(2)) not in codec[1]:
        raise ElevenLabsError(
            400,
            "invalid_output_format",
            f"output_format {name[:40]!r} is not made by this server (ChatTTS speaks at 24 kHz); "
            f"use one of {list(SUPPORTED)}",
        )
    ours, _, content_type = codec
    return OutputFormat(name, ours, int(match.group(2)), content_type)


def unknown_voice(unknown: UnknownVoice) -> ElevenLabsError:
    """ElevenLabs' answer to a voice it does not have, naming the voices this server has."""
    message = f"A voice with the voice_id {unknown.name} was not found. Voices here: {unknown.choices}."
    return ElevenLabsError(404, "voice_not_found", message)


#: ElevenLabs' 0-to-1 settings.
_Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class VoiceSettings(msgspec.Struct, forbid_unknown_fields=False, frozen=True):
    """ElevenLabs' ``voice_settings``, each field checked: an object, numbers within their ranges.

    ``speed`` is used (clamped to ours); ChatTTS has no control for the others, which are
    checked and ignored; unknown fields are ignored too.
    """

    speed: Annotated[float, msgspec.Meta(ge=ELEVENLABS_SPEED[0], le=ELEVENLABS_SPEED[1])] | None = None
    stability: _Unit | None = None
    similarity_boost: _Unit | None = None
    style: _Unit | None = None
    use_speaker_boost: bool | None = None


def voice_settings(value: object) -> VoiceSettings | None:
    """An ElevenLabs WebSocket message's ``voice_settings`` (decoded without a type), checked.

    Raises:
        BadMessage: not an object, or a field of the wrong type or out of its range.
    """
    return None if value is None else convert(value, VoiceSettings, "voice_settings")


def speed_of(settings: VoiceSettings | None) -> float:
    """The speed in ``voice_settings`` clamped to ours, 1.0 when absent."""
    if settings is None or settings.speed is None:
        return 1.0
    return min(OUR_SPEED[1], max(OUR_SPEED[0], settings.speed))
