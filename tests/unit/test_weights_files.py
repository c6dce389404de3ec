"""The weight files' table, folder checks and where ``serve`` looks (no network, no torch)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

from server.cli import main
from server.config import load_settings
from server.engine.weights.files import (
    ASSET_FILES,
    OFFICIAL_SIZES,
    Expected,
    WeightsError,
    chattts_sha256_map,
    check_folder,
    expected_files,
)
from server.engine.weights.locate import locate

REPO = Path(__file__).resolve().parents[2]
PATHS = [path for path, _ in ASSET_FILES]


@pytest.mark.skipif(importlib.util.find_spec("ChatTTS") is None, reason="ChatTTS is not installed")
def test_chattts_own_map_is_read_without_importing_it_and_every_file_has_its_hub_size() -> None:
    expected = expected_files(chattts_sha256_map())
    assert [f.path for f in expected] == PATHS
    # Every size applies: the table's hashes are the installed ChatTTS's (a new map would show here).
    assert {f.path: (f.size, f.sha256) for f in expected} == OFFICIAL_SIZES


def test_a_size_is_held_only_against_the_hash_it_was_measured_for() -> None:
    official = {key: OFFICIAL_SIZES[path][1] for path, key in ASSET_FILES}
    official["sha256_asset_Vocos_safetensors"] = "0" * 64  # a newer map: the old size no longer applies
    sizes = {f.path: f.size for f in expected_files(official)}
    assert sizes["asset/Vocos.safetensors"] is None
    assert sizes["asset/gpt/model.safetensors"] == 853_423_872


def test_a_map_without_a_file_chattts_checks_is_refused_by_name() -> None:
    with pytest.raises(WeightsError, match="sha256_asset_gpt_config_json"):
        expected_files({key: "0" * 64 for _, key in ASSET_FILES if key != "sha256_asset_gpt_config_json"})


def _folder(tmp_path: Path) -> tuple[Path, tuple[Expected, ...]]:
    expected = []
    for i, path in enumerate(PATHS):
        data = f"file {i}".encode() * (i + 1)
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
        expected.append(Expected(path, hashlib.sha256(data).hexdigest(), len(data)))
    return tmp_path, tuple(expected)


def test_check_folder_names_the_missing_the_truncated_and_the_different(tmp_path: Path) -> None:
    folder, expected = _folder(tmp_path)
    assert check_folder(folder, expected) == []
    (folder / PATHS[0]).unlink()
    truncated = folder / PATHS[1]
    truncated.write_bytes(truncated.read_bytes()[:-1])
    different = folder / PATHS[2]
    different.write_bytes(different.read_bytes().upper())  # same size
    problems = {p.path: p.what for p in check_folder(folder, expected)}
    assert problems.keys() == {PATHS[0], PATHS[1], PATHS[2]}
    assert problems[PATHS[0]] == "missing"
    size = expected[1].size
    assert size is not None and problems[PATHS[1]] == f"{size - 1} bytes, expected {size} (cut short)"
    assert problems[PATHS[2]].startswith("sha256 ")
    assert [p.path for p in check_folder(folder, expected, hashes=False)] == [PATHS[0], PATHS[1]]


def test_verify_with_a_map_and_a_folder_without_asset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, expected = _folder(tmp_path / "w")
    sha_map = tmp_path / "map.json"
    sha_map.write_text(json.dumps({key: f.sha256 for (_, key), f in zip(ASSET_FILES, expected, strict=True)}))
    assert main(["weights", "verify", str(folder), "--sha256-map", str(sha_map)]) == 0
    assert f"all 9 files match the sha256 map {sha_map}" in capsys.readouterr().out
    assert main(["weights", "verify", str(tmp_path), "--sha256-map", str(sha_map)]) == 1
    assert "no asset/ folder here" in capsys.readouterr().out
    sha_map.write_text("[1, 2]")
    assert main(["weights", "verify", str(folder), "--sha256-map", str(sha_map)]) == 1
    assert "is not a sha256 map" in capsys.readouterr().err


def test_serve_looks_in_dev_model_then_model_dir_then_the_hub_cache(tmp_path: Path) -> None:
    both = load_settings(["--dev-model", "tiny", "--model-dir", "/m", "--cache-dir", str(tmp_path)], env={})
    assert locate(both, look_in_cache=False).folder == tmp_path / "dev-tiny"
    assert locate(load_settings(["--model-dir", "/m"], env={})).folder == Path("/m")
    hub = locate(load_settings([], env={"CHATTTS_CACHE_DIR": str(tmp_path)}))
    assert (hub.source, hub.folder, hub.cache) == ("hub-cache", None, tmp_path / "hub")


def test_where_reads_the_same_variables_as_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHATTTS_CACHE_DIR", str(tmp_path))
    assert main(["weights", "where"]) == 1  # nothing downloaded there yet
    out = capsys.readouterr().out
    assert f"the hub cache {tmp_path / 'hub'} (--cache-dir" in out
    assert f"state: missing (`chattts-stream weights download --cache-dir {tmp_path}` fetches them" in out
    assert main(["weights", "where", "--dev-model", "tiny"]) == 0  # serve writes it on its first start
    assert f"serve looks in: {tmp_path / 'dev-tiny'} (--dev-model" in capsys.readouterr().out


def test_the_docs_list_every_file_with_its_size() -> None:
    text = (REPO / "docs" / "weights.md").read_text()
    for path, (size, _) in OFFICIAL_SIZES.items():
        row = next((line for line in text.splitlines() if f"`{path}`" in line), None)
        assert row is not None, f"docs/weights.md does not list {path}"
        assert re.search(rf"\b{size:,}\b", row), f"docs/weights.md: {path} is not {size:,} bytes"


def test_where_names_what_is_missing_and_the_download_that_fills_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, expected = _folder(tmp_path / "w")
    sha_map = tmp_path / "map.json"
    sha_map.write_text(json.dumps({key: f.sha256 for (_, key), f in zip(ASSET_FILES, expected, strict=True)}))
    where = ["weights", "where", "--model-dir", str(folder), "--sha256-map", str(sha_map)]
    assert main(where) == 0
    assert "state: present (9 files" in capsys.readouterr().out
    (folder / PATHS[4]).unlink()
    assert main(where) == 1
    out = capsys.readouterr().out
    assert f"  {PATHS[4]}: missing\n" in out
    assert f"state: incomplete (1 of 9 files): `chattts-stream weights download --dir {folder}`" in out
    assert main(["weights", "where", "--model-dir", str(tmp_path / "none")]) == 1
    assert "state: missing (no such folder;" in capsys.readouterr().out
