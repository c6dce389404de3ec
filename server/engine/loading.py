"""Choosing and constructing the ChatTTS engine from settings (no torch import here).

Kept apart from ``engine/chattts.py`` so that the server can be configured,
and its errors reported, without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from server.config import Settings

if TYPE_CHECKING:
    from server.engine.base import Engine


class ModelUnavailable(Exception):
    """The model cannot be loaded (no weights, refused dev model); the message says what to do."""


def chattts_engine_factory(settings: Settings) -> Callable[[], Engine]:
    """A constructor for the ChatTTS engine described by ``settings``."""

    def build() -> Engine:
        from server.engine.chattts import ChatTTSEngine

        return ChatTTSEngine.load(model_dir=settings.model_dir or None)

    return build
