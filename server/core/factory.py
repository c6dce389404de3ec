"""What the flags say the inference loop runs: the engine's constructor and the policy's tuning.

Shared by the in-process form (``server.app`` builds the core on a thread) and the engine
process (``server.core.remote.host`` builds it there), so both read the same flags the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from server.config import Settings
from server.core.policy import PolicyConfig
from server.engine_api import Engine
from server.errors import StartupError


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


def text_side(settings: Settings) -> Engine:
    """What the front end asks of the engine's text pipeline when the engine runs in its own process.

    ``validate_voice`` and ``text_tokens`` are answered in the front end's process, at once
    (the stream layer asks them synchronously while it checks a request). The fake engine's
    answers are pure functions of the text, so an unstepped instance of it answers them.

    Raises:
        StartupError: the ChatTTS engine's text side (its tokenizer, normalizer and speaker
            bank) is not separable from its model yet, so ``--engine-process`` needs ``--engine fake``.
    """
    if settings.engine != "fake":
        raise StartupError(
            "--engine-process runs only the fake engine for now: ChatTTS's tokenizer and normalizer "
            "would be loaded in the front end as well (set --engine fake, or leave --engine-process off)"
        )
    return fake_engine(settings)


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
