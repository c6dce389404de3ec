"""Loading: dev-model manifest, hash checks, and the offline error path."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from server.engine.chattts.assets import ModelUnavailableError, fetch_official, load_chat, read_dev_manifest


def test_dev_model_is_marked_and_hash_checked(tiny_model_dir: Path) -> None:
    manifest = read_dev_manifest(tiny_model_dir)
    assert manifest is not None and manifest["random_weights"] is True
    assert manifest["size"] == "tiny" and len(manifest["sha256"]) == 9


def test_tiny_model_loads_fast(tiny_model_dir: Path) -> None:
    import torch

    # (How fast is the bench's to show: a wall-clock bound here fails on a loaded machine.)
    loaded = load_chat(model_dir=tiny_model_dir, device=torch.device("cpu"))
    assert loaded.random_weights


def test_tampered_file_fails_hash_check(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch

    copy = tmp_path / "m"
    shutil.copytree(tiny_model_dir, copy)
    cfg_path = copy / "asset" / "gpt" / "config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text())) + " ")
    with pytest.raises(ModelUnavailableError, match="hashes"):
        load_chat(model_dir=copy, device=torch.device("cpu"))


def test_folder_without_assets_is_actionable(tmp_path: Path) -> None:
    import torch

    with pytest.raises(ModelUnavailableError, match="make-dev-model"):
        load_chat(model_dir=tmp_path, device=torch.device("cpu"))


def _assert_actionable(exc: ModelUnavailableError) -> None:
    text = str(exc)
    assert "\n" not in text
    assert "--model-dir" in text and "--dev-model" in text and "2Noise/ChatTTS" in text
    assert "`chattts-stream weights download`" in text  # the command that fetches them


def test_offline_env_fails_fast(tmp_path: Path) -> None:
    from server.engine.chattts.engine import ChatTTSEngine

    # Fast because nothing is tried: the autouse fixture fails any connect or DNS lookup.
    with pytest.raises(ModelUnavailableError) as info:
        ChatTTSEngine.load(model_dir=None, cache_dir=tmp_path / "cache", device="cpu")
    _assert_actionable(info.value)
    assert "HF_HUB_OFFLINE" in str(info.value)


def test_unreachable_hub_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No HF_HUB_OFFLINE, but every connect fails as on a machine without a network."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    attempts: list[object] = []

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args)
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(ModelUnavailableError) as info:
        fetch_official(cache_dir=tmp_path / "cache", timeout_s=1.0)
    assert len(attempts) == 1  # fails fast: one try, no retries (counted, not timed)
    _assert_actionable(info.value)
    assert "cannot reach" in str(info.value)
