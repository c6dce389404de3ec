"""Finding, fetching, verifying and loading ChatTTS weights.

Two sources:

* a model folder in ChatTTS's asset layout (``DIR/asset/...``): either the
  official weights (hash-checked against ChatTTS's own ``sha256_map.json``)
  or a random-weight dev model written by
  :func:`server.engine.chattts.devmodel.make_dev_model` (hash-checked against
  its ``DEV_MODEL.json`` manifest);
* no folder: the official weights from the Hugging Face hub
  (``2Noise/ChatTTS``), downloaded once into a cache and reused. Offline,
  loading fails fast with :class:`ModelUnavailableError`.

With ``verify="none"`` (``--verify-weights none``) a folder without a dev
manifest is loaded without ChatTTS's hash check, so fine-tuned checkpoints
in ChatTTS's layout can be served; they are reported as ``unverified``.
ChatTTS 0.2.5 reads only ``asset/`` (its module sizes are fixed in
``ChatTTS.config.Config``; only the Llama's ``asset/gpt/config.json`` is read),
so such a checkpoint must keep the official architecture.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from server.engine.chattts.devmodel import build_config
from server.engine.weights.files import (
    ASSET_FILES,
    WeightsError,
    chattts_sha256_map,
    expected_files,
    read_manifest,
)
from server.engine.weights.hub import REPO_ID as HF_REPO_ID
from server.engine.weights.hub import (
    DownloadError,
    HashMismatch,
    cached_snapshot,
    download,
    unreachable_reason,
)

Verify = Literal["official", "none"]
#: Only the files ChatTTS loads (the hub repo also holds old .pt files): those `weights download` fetches.
HF_ALLOW_PATTERNS = [path for path, _ in ASSET_FILES]

log = logging.getLogger(__name__)


class ModelUnavailableError(RuntimeError):
    """The weights cannot be found or fetched; the message says what to do.

    The message is one line, meant to be printed as-is by the CLI before it
    exits non-zero.
    """

    code = "model_unavailable"


@dataclass(frozen=True)
class LoadedChat:
    """A loaded ``ChatTTS.Chat`` plus where it came from.

    Attributes:
        chat: the loaded ``ChatTTS.Chat`` (modules: gpt, embed, decoder, vocos, tokenizer, speaker).
        model_dir: the folder holding ``asset/``.
        dev_manifest: the ``DEV_MODEL.json`` content when the weights are random, else ``None``.
        verified: the files matched a hash map (ChatTTS's official one, or the dev manifest's).
    """

    chat: Any
    model_dir: Path
    dev_manifest: dict[str, Any] | None
    verified: bool = True

    @property
    def random_weights(self) -> bool:
        """Whether these are random (dev) weights rather than the official ones."""
        return self.dev_manifest is not None

    @property
    def weights(self) -> str:
        """``"random"`` (a dev model), ``"official"`` (hash-checked) or ``"unverified"``."""
        if self.random_weights:
            return "random"
        return "official" if self.verified else "unverified"


def default_cache_dir() -> Path:
    """Where hub downloads go: ``$CHATTTS_CACHE_DIR`` or the Hugging Face hub cache."""
    env = os.environ.get("CHATTTS_CACHE_DIR")
    if env:
        return Path(env)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def read_dev_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The dev-model manifest of ``model_dir``, or ``None`` for official weights."""
    try:
        return read_manifest(model_dir)
    except WeightsError as exc:
        raise ModelUnavailableError(str(exc)) from None


def _missing_assets(model_dir: Path) -> list[str]:
    return [rel for rel, _ in ASSET_FILES if not (model_dir / rel).is_file()]


def _offline_message(cache_dir: Path, reason: str) -> str:
    return (
        f"ChatTTS weights are not in the cache {cache_dir} and cannot be downloaded from the Hugging Face "
        f"hub "
        f"({HF_REPO_ID}): {reason}. Fix: run `chattts-stream weights download` where the hub (or a mirror "
        "named by HF_ENDPOINT) can be reached, then copy the folder here and pass --model-dir DIR "
        "(docs/weights.md lists the files), or serve random test weights with `--dev-model tiny` "
        "(noise, not speech)."
    )


def fetch_official(*, cache_dir: Path | None = None, timeout_s: float = 5.0) -> Path:
    """Return a local folder with the official weights, downloading them once if needed.

    Args:
        cache_dir: hub cache folder (default :func:`default_cache_dir`).
        timeout_s: connect/read timeout for the hub; offline fails within about this long.

    Raises:
        ModelUnavailableError: not cached and the hub is unreachable or the download failed.
    """
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    cached = cached_snapshot(cache, HF_ALLOW_PATTERNS)  # what `chattts-stream weights where` reports
    if cached is not None and not _missing_assets(cached):
        return cached
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ModelUnavailableError(_offline_message(cache, "HF_HUB_OFFLINE is set"))
    reason = unreachable_reason(timeout_s)
    if reason is not None:
        raise ModelUnavailableError(_offline_message(cache, reason))
    log.warning("downloading the ChatTTS weights from the Hugging Face hub (%s) into %s", HF_REPO_ID, cache)
    previous = os.environ.get("HF_HUB_ETAG_TIMEOUT")
    os.environ["HF_HUB_ETAG_TIMEOUT"] = str(max(1, int(timeout_s)))
    try:
        # The same download as `chattts-stream weights download`: resumed when a transfer breaks,
        # every file hashed, and one that differs deleted (else every later start would meet it).
        return download(expected_files(chattts_sha256_map()), cache_dir=cache, retries=2, say=log.info)
    except HashMismatch as exc:
        raise ModelUnavailableError(str(exc)) from None
    except DownloadError as exc:
        raise ModelUnavailableError(_offline_message(cache, str(exc))) from None
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_ETAG_TIMEOUT", None)
        else:
            os.environ["HF_HUB_ETAG_TIMEOUT"] = previous


def new_chat(manifest: dict[str, Any] | None) -> Any:
    """A ``ChatTTS.Chat`` with no module loaded yet: its config, hash map and normalizer.

    The official config and hash map, or (``manifest``: a dev model's ``DEV_MODEL.json``) the dev
    model's: its sizes and speaker statistics, and its files' hashes. The normalizer is built
    here (``Chat.__init__``), from the ``homophones_map.json`` inside the ChatTTS package.
    """
    import ChatTTS

    chat = ChatTTS.Chat(logging.getLogger("ChatTTS"))
    if manifest is not None:
        chat.config = build_config(manifest.get("config") or None)
        # Random files fail ChatTTS's official hash map by design; check them against the manifest.
        chat.sha256_map = dict(manifest["sha256"])
    # else: keep ChatTTS's own official sha256_map: real weights are hash-checked unless told not to.
    return chat


def load_chat(
    *,
    model_dir: Path | str | None,
    device: torch.device,
    cache_dir: Path | None = None,
    download_timeout_s: float = 5.0,
    verify: Verify = "official",
) -> LoadedChat:
    """Load ChatTTS's modules from ``model_dir`` (or the official weights) onto ``device``.

    Args:
        model_dir: folder holding ``asset/``; ``None`` = official weights via the hub cache.
        device: torch device for every module.
        cache_dir: hub cache for ``model_dir=None``.
        download_timeout_s: hub timeout for ``model_dir=None``.
        verify: ``"official"`` checks the files against ChatTTS's official sha256 map (a dev
            model against its manifest); ``"none"`` skips that check for folders without a
            dev manifest (fine-tuned weights), with one warning line.

    Raises:
        ModelUnavailableError: missing files, failed hash check, or no way to download.
    """
    folder = (
        Path(model_dir)
        if model_dir is not None
        else fetch_official(cache_dir=cache_dir, timeout_s=download_timeout_s)
    )
    if not (folder / "asset").is_dir():
        raise ModelUnavailableError(
            f"{folder} has no asset/ folder: pass --model-dir the folder that contains asset/ "
            f"(ChatTTS's layout), or run `chattts-stream make-dev-model --size tiny {folder}`"
        )
    missing = _missing_assets(folder)
    if missing:
        raise ModelUnavailableError(
            f"{folder} is incomplete, missing: {', '.join(missing)} "
            f"(`chattts-stream weights download --dir {folder}` fetches them)"
        )
    manifest = read_dev_manifest(folder)
    started = time.perf_counter()
    chat = new_chat(manifest)
    unverified = manifest is None and verify == "none"
    if unverified:
        log.warning(
            "UNVERIFIED WEIGHTS: loading %s without checking it against ChatTTS's official hashes "
            "(--verify-weights none); hello and /metrics report weights=unverified",
            folder,
        )
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    # ChatTTS deletes the Llama's embed_tokens (it has its own Embed), so transformers'
    # "weights newly initialized: embed_tokens" notice is expected noise.
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        ok = _load_unverified(chat, folder, device) if unverified else _load_checked(chat, folder, device)
    finally:
        hf_logging.set_verbosity(verbosity)
    if not ok:
        if manifest is not None:
            raise ModelUnavailableError(
                f"loading ChatTTS from {folder} failed (files do not match the DEV_MODEL.json hashes, "
                "or a module failed to load); regenerate the folder"
            )
        raise ModelUnavailableError(
            f"loading ChatTTS from {folder} failed: its files do not match ChatTTS's official sha256 map "
            f"(`chattts-stream weights verify {folder}` names them; `chattts-stream weights download` "
            "fetches them anew), or a module failed to load; to serve fine-tuned or otherwise modified "
            "weights pass --verify-weights none (CHATTTS_VERIFY_WEIGHTS=none)"
        )
    log.info("ChatTTS modules loaded from %s in %.2f s", folder, time.perf_counter() - started)
    return LoadedChat(chat=chat, model_dir=folder, dev_manifest=manifest, verified=not unverified)


def _load_checked(chat: Any, folder: Path, device: torch.device) -> bool:
    """``Chat.load`` from a folder: ChatTTS checks every file's sha256 against ``chat.sha256_map``."""
    ok: bool = chat.load(source="custom", custom_path=str(folder), compile=False, device=device)
    return ok


def _load_unverified(chat: Any, folder: Path, device: torch.device) -> bool:
    """What ``Chat.load`` does after its hash check (``Chat._load`` with the asset paths).

    ``Chat.load(source="custom")`` cannot skip ``check_all_assets``; ``_load`` is the rest of
    it (ChatTTS is pinned at 0.2.5). A file with the wrong shapes raises from ``load_state_dict``:
    that becomes a one-line :class:`ModelUnavailableError`.
    """
    paths = {key: str(folder / rel) for key, rel in asdict(chat.config.path).items()}
    try:
        ok: bool = chat._load(device=device, compile=False, **paths)
    except Exception as exc:  # shape mismatches, truncated files: the user's checkpoint is wrong
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelUnavailableError(
            f"loading the unverified weights in {folder} failed: {first[:300]} "
            "(ChatTTS 0.2.5 needs the official architecture sizes)"
        ) from None
    return ok
