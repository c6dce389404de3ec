"""Where ``serve`` looks for the weights: the one answer the server and ``weights where`` share.

In order: ``--dev-model SIZE`` (random weights, written once under the cache folder);
``--model-dir DIR``; else the official weights in the hub cache under ``--cache-dir``
(``~/.cache/chattts-stream/hub``), which the first start fills when it can reach the hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from server.config import Settings
from server.engine.weights.files import ASSET_FILES

Source = Literal["model-dir", "dev-model", "hub-cache"]


def cache_root(settings: Settings) -> Path:
    """Where downloaded weights and generated dev models are kept."""
    if settings.cache_dir:
        return Path(settings.cache_dir).expanduser()
    return Path.home() / ".cache" / "chattts-stream"


def hub_cache(settings: Settings) -> Path:
    """The hub cache ``serve`` downloads the official weights into (and ``weights download`` fills)."""
    return cache_root(settings) / "hub"


@dataclass(frozen=True)
class Location:
    """Where the weights of one ``serve`` configuration are.

    Attributes:
        source: which setting decides it.
        folder: the folder holding ``asset/``; ``None`` where the hub cache has no snapshot yet.
        cache: the hub cache (``source == "hub-cache"``), else ``None``.
    """

    source: Source
    folder: Path | None
    cache: Path | None = None

    def describe(self) -> str:
        """One line: where, and which flag chose it."""
        if self.source == "model-dir":
            return f"{self.folder} (--model-dir, CHATTTS_MODEL_DIR)"
        if self.source == "dev-model":
            return f"{self.folder} (--dev-model: RANDOM weights, written there on the first start)"
        where = self.folder if self.folder is not None else "no snapshot yet"
        return (
            f"the hub cache {self.cache} (--cache-dir, CHATTTS_CACHE_DIR): 2Noise/ChatTTS, "
            f"revision main: {where}"
        )


def dev_model_dir(settings: Settings) -> Path:
    """The folder of ``--dev-model``'s random weights."""
    return cache_root(settings) / f"dev-{settings.dev_model}"


def locate(settings: Settings, *, look_in_cache: bool = True) -> Location:
    """Where ``serve`` with ``settings`` takes its weights from.

    Args:
        settings: the server's settings (only ``model_dir``, ``dev_model``, ``cache_dir`` count).
        look_in_cache: find the cached snapshot (imports huggingface_hub); the server finds it later,
            in :func:`server.engine.chattts.assets.fetch_official`, and downloads it there if missing.
    """
    if settings.dev_model:  # wins over --model-dir, as it always has
        return Location("dev-model", dev_model_dir(settings))
    if settings.model_dir:
        return Location("model-dir", Path(settings.model_dir).expanduser())
    cache = hub_cache(settings)
    if not look_in_cache:
        return Location("hub-cache", None, cache)
    from server.engine.weights.hub import cached_snapshot

    return Location("hub-cache", cached_snapshot(cache, [path for path, _ in ASSET_FILES]), cache)
