"""The files ChatTTS loads, what each must hash to, and checking a folder against that.

ChatTTS 0.2.5 loads nine files from ``asset/`` and checks each against its own
``ChatTTS/res/sha256_map.json`` (``check_all_assets``). That map is the one authority on what
the official weights are; it is read here from the installed package's folder, without importing
ChatTTS (which imports torch). A random-weight dev model carries its own map in
``DEV_MODEL.json``, written by ``make-dev-model``.

The map holds no sizes. :data:`OFFICIAL_SIZES` holds the hub's sizes of the official files
(``2Noise/ChatTTS`` at revision ``1a3c04a``), each paired with the sha256 it was measured for:
a size is only held against a file whose expected hash is that one, so a newer map never meets a
stale size. Sizes let ``verify`` name a truncated copy without hashing it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: File name of the manifest that marks a folder as random weights.
DEV_MANIFEST = "DEV_MODEL.json"
DEV_MANIFEST_KIND = "chattts-stream-dev-model"

#: Files ChatTTS's ``check_all_assets`` hashes, as (relative path, sha256_map key).
ASSET_FILES: tuple[tuple[str, str], ...] = (
    ("asset/Decoder.safetensors", "sha256_asset_Decoder_safetensors"),
    ("asset/DVAE.safetensors", "sha256_asset_DVAE_safetensors"),
    ("asset/Embed.safetensors", "sha256_asset_Embed_safetensors"),
    ("asset/Vocos.safetensors", "sha256_asset_Vocos_safetensors"),
    ("asset/gpt/config.json", "sha256_asset_gpt_config_json"),
    ("asset/gpt/model.safetensors", "sha256_asset_gpt_model_safetensors"),
    ("asset/tokenizer/special_tokens_map.json", "sha256_asset_tokenizer_special_tokens_map_json"),
    ("asset/tokenizer/tokenizer_config.json", "sha256_asset_tokenizer_tokenizer_config_json"),
    ("asset/tokenizer/tokenizer.json", "sha256_asset_tokenizer_tokenizer_json"),
)

#: The official files' sizes in bytes on the hub, keyed by path, with the sha256 they belong to.
OFFICIAL_SIZES: dict[str, tuple[int, str]] = {
    "asset/Decoder.safetensors": (
        103_694_920,
        "77aa55e0a977949c4733df3c6f876fa85860d3298cba63295a7bc6901729d4e0",
    ),
    "asset/DVAE.safetensors": (
        60_359_112,
        "1d0b044a8368c0513100a2eca98456b289e6be6a18b7a63be1bcaa315ea874d9",
    ),
    "asset/Embed.safetensors": (
        145_598_536,
        "2ff0be7134934155741b643b74e32fb6bf3eec41257984459b2ed60cdb4c48b0",
    ),
    "asset/Vocos.safetensors": (
        54_348_240,
        "07e5561491cce41f7f90cfdb94b2ff263ff5742c3d89339db99b17ad82cc3f44",
    ),
    "asset/gpt/config.json": (762, "0aaa1ecd96c49ad4f473459eb1982fa7ad79fa5de08cde2781bf6ad1f9a0c236"),
    "asset/gpt/model.safetensors": (
        853_423_872,
        "cd0806fd971f52f6a22c923ec64982b305e817bcc41ca83417fcf9141b984a0f",
    ),
    "asset/tokenizer/special_tokens_map.json": (
        7_847,
        "bd0ac9d9bb1657996b5c5fbcaa7d80f8de530d01a283da97f89deae5b1b8d011",
    ),
    "asset/tokenizer/tokenizer_config.json": (
        11_028,
        "43e9d658b554fa5ee8d8e1d763349323bfef1ed7a89c0794220ab8861387d421",
    ),
    "asset/tokenizer/tokenizer.json": (
        448_604,
        "843838a64e121e23e774cc75874c6fe862198d9f7dd43747914633a8fd89c20e",
    ),
}


class WeightsError(RuntimeError):
    """A hash map or a folder cannot be read; the one-line message says which and why."""


@dataclass(frozen=True)
class Expected:
    """One file a folder must hold.

    Attributes:
        path: relative to the folder, with ``/`` (``asset/gpt/model.safetensors``).
        sha256: what its content must hash to.
        size: its size in bytes where known (the official files), else ``None``.
    """

    path: str
    sha256: str
    size: int | None = None


@dataclass(frozen=True)
class Problem:
    """What is wrong with one file of a folder (``what``: one line for a person)."""

    path: str
    what: str


def chattts_sha256_map() -> dict[str, str]:
    """The installed ChatTTS's own ``res/sha256_map.json`` (the package is located, not imported).

    Raises:
        WeightsError: ChatTTS is not installed, or its map cannot be read.
    """
    spec = importlib.util.find_spec("ChatTTS")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(
            "ChatTTS is not installed, so its sha256 map is not here: install the model extra "
            "(pip install '.[model]'), or pass --sha256-map FILE"
        )
    return read_sha256_map(Path(next(iter(spec.submodule_search_locations))) / "res" / "sha256_map.json")


def read_sha256_map(path: Path) -> dict[str, str]:
    """A hash map in ChatTTS's format (``{"sha256_asset_DVAE_safetensors": "1d0b…", …}``).

    Raises:
        WeightsError: the file is missing, not JSON, or not a map of strings.
    """
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"cannot read the sha256 map {path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise WeightsError(f"{path} is not a sha256 map (a JSON object of file key to hex digest)")
    return {str(k): v.lower() for k, v in data.items()}


def expected_files(sha256_map: Mapping[str, str]) -> tuple[Expected, ...]:
    """The nine files ChatTTS loads, with their hashes from ``sha256_map`` (and official sizes).

    Raises:
        WeightsError: the map lacks a file ChatTTS checks (it would fail ChatTTS's own check).
    """
    missing = [key for _, key in ASSET_FILES if key not in sha256_map]
    if missing:
        raise WeightsError(f"the sha256 map has no entry for {', '.join(missing)}")
    found = []
    for path, key in ASSET_FILES:
        digest = sha256_map[key].lower()
        official = OFFICIAL_SIZES.get(path)
        size = official[0] if official is not None and official[1] == digest else None
        found.append(Expected(path=path, sha256=digest, size=size))
    return tuple(found)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The ``DEV_MODEL.json`` of ``folder`` (random weights), or ``None`` where there is none.

    Raises:
        WeightsError: the file is there but is not a chattts-stream dev-model manifest.
    """
    path = folder / DEV_MANIFEST
    if not path.is_file():
        return None
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"cannot read {path}: {exc}") from None
    if (
        not isinstance(data, dict)
        or data.get("kind") != DEV_MANIFEST_KIND
        or not data.get("random_weights")
        or not isinstance(data.get("sha256"), dict)
    ):
        raise WeightsError(f"{path} is not a chattts-stream dev-model manifest; remove it or regenerate")
    return data


def sha256_of(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks (``on_bytes`` is told each block's length)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            if on_bytes is not None:
                on_bytes(len(block))
    return digest.hexdigest()


def check_file(folder: Path, file: Expected, *, hashes: bool = True) -> Problem | None:
    """What is wrong with ``folder/file.path`` (missing, wrong size, wrong sha256), or ``None``.

    The size is compared first, so a truncated copy is named without reading it.
    """
    target = folder / file.path
    if not target.is_file():
        dangling = " (a link to a file that is gone)" if target.is_symlink() else ""
        return Problem(file.path, f"missing{dangling}")
    size = target.stat().st_size
    if file.size is not None and size != file.size:
        short = " (cut short)" if size < file.size else ""
        return Problem(file.path, f"{size:,} bytes, expected {file.size:,}{short}")
    if hashes:
        digest = sha256_of(target)
        if digest != file.sha256:
            return Problem(file.path, f"sha256 {digest}, expected {file.sha256}")
    return None


def check_folder(folder: Path, expected: tuple[Expected, ...], *, hashes: bool = True) -> list[Problem]:
    """Every problem of ``folder`` against ``expected``: empty when ChatTTS's check would pass."""
    return [p for p in (check_file(folder, f, hashes=hashes) for f in expected) if p is not None]
