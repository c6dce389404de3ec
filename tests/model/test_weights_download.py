"""``chattts-stream weights`` as a user runs it, against a stand-in hub on 127.0.0.1.

The stand-in (tests/hubserver.py) speaks the hub's file API and serves the tiny dev model's files
as ``2Noise/ChatTTS``; the expected hashes are the dev model's (``--sha256-map``), where a user
gets ChatTTS's own. The command runs in a subprocess with ``HF_ENDPOINT`` pointing at the
stand-in and ``HF_HOME`` in a temporary folder, as a user's shell would run it, and its sockets
reach nothing but loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import main
from server.engine.chattts.assets import fetch_official
from server.engine.weights.files import ASSET_FILES
from server.engine.weights.hub import REPO_ID
from tests.hubserver import COMMIT, FakeHub, HubServer

pytestmark = pytest.mark.loopback  # the stand-in hub on 127.0.0.1

REPO = Path(__file__).resolve().parents[2]
FILES = [path for path, _ in ASSET_FILES]
EMBED = "asset/Embed.safetensors"
VOCOS = "asset/Vocos.safetensors"
#: The command under the loopback guard: it may reach the stand-in hub and nothing else.
CHILD = (
    "import sys\n"
    "from tests.netguard import loopback_only\n"
    "from server.cli import main\n"
    "with loopback_only(hub_offline=False):\n"
    "    sys.exit(main(sys.argv[1:]))\n"
)


@pytest.fixture
def hub(tiny_model_dir: Path) -> FakeHub:
    return FakeHub.from_folder(REPO_ID, tiny_model_dir, FILES)


@pytest.fixture
def sha_map(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The dev model's hashes in ChatTTS's sha256_map.json format."""
    path = tmp_path / "sha256_map.json"
    path.write_text(json.dumps(json.loads((tiny_model_dir / "DEV_MODEL.json").read_text())["sha256"]))
    return path


def weights(
    *args: str, home: Path, hub_url: str | None = None, child: str = CHILD
) -> subprocess.CompletedProcess[str]:
    """``chattts-stream weights ARGS`` in a fresh process: no proxy, no HF_*/CHATTTS_* of ours."""
    env = {
        k: v
        for k, v in os.environ.items()
        if "proxy" not in k.lower() and not k.startswith(("HF_", "HUGGINGFACE_", "CHATTTS_"))
    }
    env |= {"HOME": str(home), "HF_HOME": str(home / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    if hub_url is not None:
        env["HF_ENDPOINT"] = hub_url
    return subprocess.run(
        [sys.executable, "-c", child, "weights", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,  # a deadline on a loaded machine, not a speed claim
    )


def snapshot_of(cache: Path) -> Path:
    return cache / "hub" / "models--2Noise--ChatTTS" / "snapshots" / COMMIT


def test_download_fetches_the_nine_files_checks_each_and_serve_and_where_find_them(
    hub: FakeHub, sha_map: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with HubServer(hub) as url:
        done = weights(
            "download", "--cache-dir", str(cache), "--sha256-map", str(sha_map), home=tmp_path, hub_url=url
        )
    assert done.returncode == 0, done.stderr
    snapshot = snapshot_of(cache)
    assert all((snapshot / p).read_bytes() == hub.files[p] for p in FILES)
    assert f"{snapshot}: all 9 files match" in done.stdout
    assert [line.split()[-1] for line in done.stderr.splitlines() if line.startswith("ok  ")] == FILES
    assert "Fetching 9 files" in done.stderr  # huggingface_hub's own progress
    # Asked as huggingface_hub asks the hub: the file list at the revision, then each file at its commit.
    assert ("GET", f"/api/models/{REPO_ID}/revision/main") in {(s.method, s.path) for s in hub.seen}
    heads = {s.path for s in hub.seen if s.method == "HEAD"}
    assert heads == {f"/{REPO_ID}/resolve/{COMMIT}/{p}" for p in FILES}  # only what ChatTTS loads

    # `where` answers with serve's folder, and serve's own loader finds the same one.
    where = weights("where", "--cache-dir", str(cache), "--sha256-map", str(sha_map), home=tmp_path)
    assert where.returncode == 0, where.stdout + where.stderr
    assert f"folder: {snapshot}\n" in where.stdout and "state: present" in where.stdout
    assert fetch_official(cache_dir=cache / "hub") == snapshot


def test_a_file_cut_off_part_way_is_resumed_with_a_range_request(
    hub: FakeHub, sha_map: Path, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    size = len(hub.files[EMBED])
    # huggingface_hub writes 10 MiB blocks: a cut past the first leaves a part on disk to resume from.
    assert size > constants.DOWNLOAD_CHUNK_SIZE + 4096, "the tiny model's Embed shrank: cut another file"
    hub.cut_once[EMBED] = size - 4096
    target = tmp_path / "weights"
    with HubServer(hub) as url:
        done = weights(
            "download", "--dir", str(target), "--sha256-map", str(sha_map), home=tmp_path, hub_url=url
        )
    assert done.returncode == 0, done.stderr
    first, second = hub.gets(EMBED)
    assert "range" not in first.headers
    start = int(second.headers["range"].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start < size  # the second request asked only for the rest
    assert (target / EMBED).read_bytes() == hub.files[EMBED]  # and the two parts make the file
    assert "resuming in" in done.stderr and "Connection broken" in done.stderr
    assert f"serve them: chattts-stream serve --model-dir {target}" in done.stdout


def test_a_failed_run_leaves_its_part_and_the_next_run_resumes_it(
    hub: FakeHub, sha_map: Path, tmp_path: Path
) -> None:
    hub.cut_once[EMBED] = len(hub.files[EMBED]) - 4096
    target = tmp_path / "weights"
    args = ("download", "--dir", str(target), "--sha256-map", str(sha_map), "--retries", "0")
    with HubServer(hub) as url:
        failed = weights(*args, home=tmp_path, hub_url=url)
        assert failed.returncode == 1
        last = failed.stderr.strip().splitlines()[-1]
        assert last.startswith("chattts-stream weights: ") and "run the command again to resume" in last
        assert "Traceback" not in failed.stderr
        assert not (target / EMBED).exists()  # the part is not taken for the file
        again = weights(*args, home=tmp_path, hub_url=url)
    assert again.returncode == 0, again.stderr
    assert "range" not in hub.gets(EMBED)[0].headers
    assert hub.gets(EMBED)[1].headers["range"].startswith("bytes=")
    assert (target / EMBED).read_bytes() == hub.files[EMBED]


@pytest.mark.parametrize("into", ["hub cache", "folder"])
def test_a_file_with_other_bytes_is_refused_by_name_and_not_kept(
    hub: FakeHub, sha_map: Path, tmp_path: Path, into: str
) -> None:
    hub.corrupt.add(VOCOS)
    cache = tmp_path / "cache"
    where = ("--cache-dir", str(cache)) if into == "hub cache" else ("--dir", str(tmp_path / "weights"))
    folder = snapshot_of(cache) if into == "hub cache" else tmp_path / "weights"
    args = ("download", *where, "--sha256-map", str(sha_map))
    with HubServer(hub) as url:
        refused = weights(*args, home=tmp_path, hub_url=url)
        assert refused.returncode == 1
        last = refused.stderr.strip().splitlines()[-1]
        assert f"{VOCOS}: sha256 " in last and "deleted" in last and "Traceback" not in refused.stderr
        assert not (folder / VOCOS).exists()
        if into == "hub cache":  # the cache would reuse a blob under the good name: none holds the bad bytes
            blobs = cache / "hub" / "models--2Noise--ChatTTS" / "blobs"
            assert all(b.read_bytes() != hub.body(VOCOS) for b in blobs.iterdir())
        hub.corrupt.clear()  # the mirror is fixed: the next run fetches the file anew
        again = weights(*args, home=tmp_path, hub_url=url)
    assert again.returncode == 0, again.stderr
    assert len(hub.gets(VOCOS)) == 2
    assert (folder / VOCOS).read_bytes() == hub.files[VOCOS]


def test_no_such_revision_fails_at_once_and_an_unreachable_hub_names_the_mirror_variable(
    hub: FakeHub, sha_map: Path, tmp_path: Path
) -> None:
    with HubServer(hub) as url:
        missing = weights(
            "download", "--revision", "nope", "--sha256-map", str(sha_map), home=tmp_path, hub_url=url
        )
    assert missing.returncode == 1
    assert "2Noise/ChatTTS@nope" in missing.stderr and "no such revision" in missing.stderr
    assert "resuming" not in missing.stderr  # not retried
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    down = weights(
        "download", "--sha256-map", str(sha_map), home=tmp_path, hub_url=f"http://127.0.0.1:{port}"
    )
    assert down.returncode == 1
    assert "unreachable" in down.stderr and "HF_ENDPOINT" in down.stderr


def test_the_servers_first_start_download_is_the_same_checked_download(hub: FakeHub, tmp_path: Path) -> None:
    """``serve`` without weights fetches them itself: held to ChatTTS's own map, as the command is.

    The stand-in serves the dev model's files, which are not ChatTTS's: every one is refused and
    none is left in the cache for the next start to take.
    """
    child = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tests.netguard import loopback_only\n"
        "from server.engine.chattts.assets import ModelUnavailableError, fetch_official\n"
        "with loopback_only(hub_offline=False):\n"
        "    try:\n"
        "        fetch_official(cache_dir=Path(sys.argv[-1]))\n"
        "    except ModelUnavailableError as exc:\n"
        "        print(exc)\n"
        "        sys.exit(2)\n"
    )
    cache = tmp_path / "hub"
    with HubServer(hub) as url:
        done = weights(str(cache), home=tmp_path, hub_url=url, child=child)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "refused 9 fetched file(s)" in done.stdout and f"{EMBED}: " in done.stdout
    snapshot = cache / "models--2Noise--ChatTTS" / "snapshots" / COMMIT
    assert not any((snapshot / p).exists() for p in FILES)
    assert not any((cache / "models--2Noise--ChatTTS" / "blobs").iterdir())


def test_verify_passes_a_good_folder_and_names_each_missing_or_different_file(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    assert main(["weights", "verify", str(folder)]) == 0
    out = capsys.readouterr()
    assert out.out.count("\nok ") + out.out.startswith("ok ") == 9
    assert "all 9 files match its DEV_MODEL.json" in out.out and "RANDOM" in out.out

    (folder / "asset" / "gpt" / "config.json").unlink()
    vocos = folder / VOCOS
    data = bytearray(vocos.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    vocos.write_bytes(bytes(data))
    assert main(["weights", "verify", str(folder)]) == 1
    out = capsys.readouterr()
    assert "MISSING  asset/gpt/config.json: missing" in out.out
    assert f"BAD      {VOCOS}: sha256 " in out.out
    assert out.out.strip().splitlines()[-1].startswith(f"{folder}: 2 of 9 files missing or different")


def test_where_prints_the_folder_serve_loads(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["weights", "where", "--model-dir", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"serve looks in: {tiny_model_dir} (--model-dir")
    assert f"folder: {tiny_model_dir}\n" in out and "state: present (9 files" in out
