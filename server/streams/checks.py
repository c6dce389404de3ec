"""A request checked before any stream exists: its encoder, its segments, its parameters.

Each check raises the domain error the front ends answer with (``server.errors``), so a
refused request starts nothing.
"""

from __future__ import annotations

import dataclasses

from server.audio import UnsupportedAudio, make_encoder
from server.audio.base import FrameEncoder
from server.config import Settings
from server.core.client import EngineClient
from server.engine_api import SynthesisParams
from server.errors import InvalidRequest, TextTooLong, Unsupported
from server.streams.request import SpeechRequest
from server.text.segments import has_speakable, split_segments
from server.text.tags import problem as tag_problem
from server.text.tags import refine_prompt_problem
from server.voices.library import StoredVoice


def stream_encoder(
    request: SpeechRequest,
    stored: StoredVoice | None,
    settings: Settings,
    engine: EngineClient,
    *,
    ogg_serial: int | None = None,
) -> FrameEncoder:
    """The stream's encoder; checks text size, control tags, format, rate and voice first.

    Args:
        request: the request.
        stored: its voice from a recording, if it names one the client may use.
        settings: the limits and the encoders' settings.
        engine: knows the built-in voices and whether refinement is on.
        ogg_serial: the Ogg stream's serial number (None: random).

    Raises:
        InvalidRequest, TextTooLong, Unsupported: what is wrong with the request.
    """
    limit = settings.max_text_chars
    if request.text is None and not request.incremental:
        raise InvalidRequest("missing field `text`")
    if request.text is not None and len(request.text) > limit:
        raise TextTooLong(f"text has {len(request.text)} characters; the limit is {limit}")
    # An incremental stream's first text may end inside a tag that a later append closes.
    if (problem := tag_problem(request.text or "", open_end=request.incremental)) is not None:
        raise InvalidRequest(problem)
    try:
        encoder = make_encoder(
            request.format,
            request.sample_rate,
            opus_bitrate=settings.opus_bitrate,
            opus_complexity=settings.opus_complexity,
            ogg_page_ms=settings.ogg_page_ms,
            mp3_bitrate=settings.mp3_bitrate,
            ogg_serial=ogg_serial,
        )
    except (UnsupportedAudio, ValueError) as exc:
        raise Unsupported(str(exc)) from None
    if stored is None and not engine.validate_voice(request.voice):
        raise Unsupported(f"unknown voice {request.voice!r}")
    if request.refine and not engine.info.refine:
        raise Unsupported("refinement is off on this server (--refine-max-tokens 0)")
    if (problem := refine_prompt_problem(request.refine_prompt)) is not None:
        raise InvalidRequest(problem)
    return encoder


def speakable_segments(text: str, max_chars: int) -> tuple[str, ...]:
    """``text`` split into segments of at most ``max_chars``, those with nothing to speak left out.

    Raises:
        InvalidRequest: none is left.
    """
    segments = tuple(seg for seg in split_segments(text, max_chars=max_chars) if has_speakable(seg))
    if not segments:
        raise InvalidRequest(
            "text has nothing to speak (ChatTTS speaks Chinese and English; "
            "other scripts, emoji and punctuation are skipped)"
        )
    return segments


def params_with_voice(request: SpeechRequest, stored: StoredVoice | None) -> SynthesisParams:
    """The request's synthesis parameters; a voice from a recording travels with them."""
    if stored is None:
        return request.params
    return dataclasses.replace(request.params, reference=stored.sample)
