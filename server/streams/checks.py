"""A request checked before any stream exists: its encoder, its segments, its parameters.

Each check raises the domain error the front ends answer with (``server.errors``), so a
refused request starts nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from server.audio import UnsupportedAudio, make_encoder
from server.audio.base import FrameEncoder
from server.config import Settings
from server.core.client import EngineClient
from server.engine_api import SynthesisParams
from server.errors import InvalidRequest, TextTooLong, Unsupported
from server.streams.request import SpeechRequest
from server.text.segments import TooManyTokens, fit_tokens, has_speakable, split_segments, unbreakable_runs
from server.text.tags import problem as tag_problem
from server.text.tags import refine_prompt_problem
from server.voices.library import StoredVoice


def stream_encoder(
    request: SpeechRequest,
    settings: Settings,
    engine: EngineClient,
    *,
    ogg_serial: int | None = None,
) -> FrameEncoder:
    """The stream's encoder; checks text size, control tags, format and rate first.

    The voice was resolved before (``VoiceCatalog.resolve``).

    Args:
        request: the request.
        settings: the limits and the encoders' settings.
        engine: knows whether refinement is on.
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
            frame_ms=request.frame_ms,
        )
    except (UnsupportedAudio, ValueError) as exc:
        raise Unsupported(str(exc)) from None
    if request.refine and not engine.info.refine:
        raise Unsupported("refinement is off on this server (--refine-max-tokens 0)")
    if (problem := refine_prompt_problem(request.refine_prompt)) is not None:
        raise InvalidRequest(problem)
    return encoder


@dataclass(frozen=True)
class PromptBudget:
    """The engine's prompt budget for one segment's text, counted as the engine counts it.

    Spelled-out numbers are many tokens a character (ChatTTS: about 12), so characters say little:
    each segment is counted by the engine (:meth:`server.engine_api.Engine.text_tokens`) before
    it is asked for, at ``start`` or ``append``, so that no segment fails inside the engine.

    Attributes:
        count: tokens of a text for the model.
        limit: the most a segment may have (``None``: the engine has no limit).
    """

    count: Callable[[str], int]
    limit: int | None

    @classmethod
    def of(cls, engine: EngineClient) -> PromptBudget:
        """The budget of ``engine`` (loaded)."""
        return cls(engine.text_tokens, engine.info.max_text_tokens)

    def fit(self, segments: Iterable[str], *, hard: bool = False) -> list[str]:
        """``segments``, each over the budget cut at clause ends or spaces (:func:`fit_tokens`).

        Raises:
            InvalidRequest: a piece with neither is over the budget (``hard``: it is cut instead,
                for text already taken, which :meth:`check_runs` checked when it came).
        """
        if self.limit is None:
            return list(segments)
        try:
            return [piece for seg in segments for piece in fit_tokens(seg, self.count, self.limit, hard=hard)]
        except TooManyTokens as exc:
            raise self._refusal(exc.piece, exc.tokens) from None

    def check_runs(self, text: str) -> None:
        """Refuse ``text`` if a run of it that cannot be cut (no clause end or space) is over the budget.

        Raises:
            InvalidRequest: the run, its tokens and the limit.
        """
        if self.limit is None:
            return
        for run in unbreakable_runs(text):
            if (tokens := self.count(run)) > self.limit:
                raise self._refusal(run, tokens)

    def _refusal(self, piece: str, tokens: int) -> InvalidRequest:
        shown = piece if len(piece) <= 40 else f"{piece[:37]}..."
        return InvalidRequest(
            f"{shown!r} is {tokens} tokens for the model (numbers are spelled out); a segment holds at "
            f"most {self.limit}: add spaces or punctuation, or write long numbers in groups"
        )


def speakable_segments(text: str, max_chars: int, engine: EngineClient | None = None) -> tuple[str, ...]:
    """``text`` in segments of at most ``max_chars`` and ``engine``'s prompt budget, each with words to speak.

    Raises:
        InvalidRequest: none is left, or a piece that cannot be cut is over the prompt budget.
    """
    segments = tuple(seg for seg in split_segments(text, max_chars=max_chars) if has_speakable(seg))
    if engine is not None:
        segments = tuple(PromptBudget.of(engine).fit(segments))
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
