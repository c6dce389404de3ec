"""What the flags say the inference loop runs: the engine's constructor and the policy's tuning.

Shared by the in-process form (``server.app`` builds the core on a thread) and the engine
process (``server.core.remote.host`` builds it there), so both read the same flags the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from server.config import Settings
from server.core.policy import PolicyConfig
from server.engine_api import Engine, EngineInfo, EngineText


def build_engine_factory(settings: Settings) -> Callable[[], Engine]:
    """The engine constructor for ``settings`` (called on the inference thread)."""
    if settings.engine == "fake":
        return lambda: fake_engine(settings)
    from server.engine.loading import chattts_engine_factory

    return chattts_engine_factory(settings)


def fake_engine(settings: Settings) -> Engine:
    """The test engine at the speed the flags give it."""
    from server.engine.fake import FakeEngine

    return FakeEngine(
        step_base_s=settings.fake_step_ms / 1000,
        step_per_row_s=settings.fake_row_ms / 1000,
        step_host_s=settings.fake_host_ms / 1000,
        refine=settings.refine_max_tokens > 0,
        voices=settings.voice_max_seconds > 0,
    )


#: Builds the front end's text side once the engine process has said what it loaded.
TextSideFactory = Callable[[EngineInfo], EngineText]


def text_side(settings: Settings) -> TextSideFactory:
    """What answers ``validate_voice`` and ``text_tokens`` in a front end whose engine is in another process.

    The stream layer asks both synchronously while it checks a request, so they are answered
    in the front end's process, at once. The fake engine's answers are pure functions of the
    text: an unstepped instance of it answers them. ChatTTS's need its tokenizer, its normalizer
    and its speaker statistics: :func:`server.engine.chattts.textside.load_text_side` loads only
    those (no GPT, DVAE, Decoder or Vocos weights) into the same
    :class:`~server.engine.chattts.textside.TextSide` the engine answers with.

    It is built from the engine's ``Loaded`` info (``ProcessLink`` calls the factory then, off
    the event loop), not before: the model folder is the one the engine process resolved,
    downloaded if it had to, and checked (its ``info.extra["model_dir"]``), so a front end never
    downloads, never races the engine host's download, and never reads files that failed the
    hash check. The flags' limits (``--segment-max-chars``, ``--refine-max-tokens``, the default
    voice) are read as the engine reads them (:func:`server.engine.flags.engine_options`).
    """
    if settings.engine == "fake":
        return lambda info: fake_engine(settings)

    def chattts(info: EngineInfo) -> EngineText:
        from server.engine.chattts.textside import load_text_side
        from server.engine.flags import engine_options

        return load_text_side(Path(info.extra["model_dir"]), engine_options(settings))

    return chattts


def policy_config(settings: Settings) -> PolicyConfig:
    """The scheduling policy's tuning from the flags."""
    return PolicyConfig(
        max_batch=settings.max_batch,
        max_wait_s=settings.max_wait_ms / 1000,
        max_queue=settings.max_queue,
        lookahead=settings.segment_lookahead,
        lookahead_lead_s=settings.lookahead_lead_s,
        breaker_threshold=settings.breaker_threshold,
        breaker_probe_interval_s=settings.breaker_probe_s,
    )
