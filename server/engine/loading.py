"""Choosing and constructing the ChatTTS engine from settings (no torch import here).

Kept apart from ``engine/chattts.py`` so that the server can be configured,
and its errors reported, without importing torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from server.config import Settings
from server.errors import StartupError
from server.voices.recording import transcript_limit

if TYPE_CHECKING:
    from server.engine_api import Engine

log = logging.getLogger(__name__)


class ModelUnavailable(StartupError):
    """The model cannot be loaded; the one-line message says what to do."""


def cache_root(settings: Settings) -> Path:
    """Where downloaded weights and generated dev models are kept."""
    if settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    return Path.home() / ".cache" / "chattts-stream"


def parse_block_schedule(text: str) -> tuple[int, ...]:
    """``"8,16,32"`` → ``(8, 16, 32)``; every entry must be a positive integer."""
    try:
        blocks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ModelUnavailable(f"--block-schedule {text!r}: expected integers such as 8,16,32") from None
    if not blocks or min(blocks) < 1:
        raise ModelUnavailable(f"--block-schedule {text!r}: every block must be at least 1 token")
    return blocks


def chattts_engine_factory(settings: Settings) -> Callable[[], Engine]:
    """A constructor for the ChatTTS engine described by ``settings`` (runs on the inference thread)."""
    blocks = parse_block_schedule(settings.block_schedule)
    if settings.prefill_bucket < 1:
        raise ModelUnavailable(f"--prefill-bucket {settings.prefill_bucket}: must be at least 1 (1: off)")
    if settings.segment_max_tokens < 1:
        raise ModelUnavailable(f"--segment-max-tokens {settings.segment_max_tokens}: must be at least 1")
    if settings.max_batch < 1:
        raise ModelUnavailable(f"--max-batch {settings.max_batch}: must be at least 1")
    if settings.refine_max_tokens < 0:
        raise ModelUnavailable(f"--refine-max-tokens {settings.refine_max_tokens}: must be 0 (off) or more")

    def build() -> Engine:
        from server.engine.chattts.assets import ModelUnavailableError
        from server.engine.chattts.devmodel import make_dev_model
        from server.engine.chattts.engine import ChatTTSEngine

        model_dir: Path | None = Path(settings.model_dir).expanduser() if settings.model_dir else None
        if settings.dev_model:
            model_dir = cache_root(settings) / f"dev-{settings.dev_model}"
            if not (model_dir / "DEV_MODEL.json").is_file():
                log.warning("writing a random-weight %s dev model to %s", settings.dev_model, model_dir)
                make_dev_model("full" if settings.dev_model == "full" else "tiny", model_dir)
        try:
            engine = ChatTTSEngine.load(
                model_dir=model_dir,
                device=settings.device,
                dtype=settings.dtype,
                num_threads=settings.threads or None,
                cache_dir=cache_root(settings) / "hub",
                verify_weights="none" if settings.verify_weights == "none" else "official",
                block_schedule=blocks,
                prefill_bucket=settings.prefill_bucket,
                warmup_prompt_chars=settings.segment_max_chars,
                max_batch=settings.max_batch,
                segment_max_tokens=settings.segment_max_tokens,
                cuda_graphs=settings.cuda_graphs == "on",
                refine_max_tokens=settings.refine_max_tokens,
                voice_max_seconds=settings.voice_max_seconds,
                voice_transcript_tokens=transcript_limit(settings.voice_max_seconds),
            )
        except ModelUnavailableError as exc:
            raise ModelUnavailable(_naming_the_flag(str(exc), settings)) from None
        except Exception as exc:  # a broken file, a device that is not there: one line, not a traceback
            cause = f"{type(exc).__name__}: {exc}"
            raise ModelUnavailable(_naming_the_flag(f"the model failed to load: {cause}", settings)) from None
        if engine.random_weights:
            log.warning("SERVING RANDOM WEIGHTS from %s: the audio is noise, not speech", model_dir)
        return engine

    return build


def _naming_the_flag(message: str, settings: Settings) -> str:
    """``message`` on one line, naming the flag to change when it does not already."""
    line = " ".join(message.split())
    if "--" in line:
        return line
    flag = "--dev-model" if settings.dev_model else "--model-dir" if settings.model_dir else "--cache-dir"
    return f"{line} (check {flag}, --device, --dtype)"
