"""The browser client (client_js/): Node unit tests, and end-to-end runs in headless Chromium.

The e2e runs start real fake-engine servers (``python -m server serve --engine fake``), drive
Debian's ``chromium`` with ``playwright-core`` (``client_js/e2e/run.mjs``) and compare the
samples the player's AudioWorklet graph rendered (a tap node after the player) with the
server's audio: bit for bit for ``pcm16``/``f32``, against libopus for ``opus``.

The demo page is driven as a user drives it: it asks for the API key of a server with
``--api-keys`` and plays once the key is typed; it shows the banner of a dev model's random
weights; ``scripts/screenshot_demo.py`` (which rewrites ``docs/screenshot-demo.png``) runs here
into a temporary file.

Needs ``node``, ``chromium`` and ``client_js/node_modules`` (``npm ci`` in ``client_js``). When
one is missing the tests skip, or fail when ``CI`` is set.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import opuslib
import pytest
from websockets.sync.client import connect

from server.audio.pcm import to_pcm16
from server.engine.fake import FAKE_VOICES, expected_audio
from server.engine_api import SequenceRequest, SynthesisParams
from server.text.segments import split_segments
from server.voices.catalog import OPENAI_VOICES
from tests.serverproc import free_port

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client_js"
CHROMIUM = Path(os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"))
DEMO_KEY = "demo-key-0123"

TEXT = "你好，欢迎使用语音服务。今天天气很好！This is a streaming test. Does it work? 最后一句话。"
SHORT = "Hello there. 再见。"
OPUS_RATE = 48_000
OPUS_PRESKIP_48K = 312


def _missing(reason: str) -> None:
    """Fail under CI (the set-up must provide it), skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is an error, not a skip)", pytrace=False)
    pytest.skip(reason)


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        _missing("node (>= 20) is not installed; the browser client's tests need it")
    assert node is not None
    return node


def _require_browser_tools() -> str:
    node = _node()
    if not (CLIENT / "node_modules" / "playwright-core").is_dir():
        _missing("client_js/node_modules is missing: run `npm ci` in client_js (installs playwright-core)")
    if not os.access(CHROMIUM, os.X_OK):
        _missing(
            f"{CHROMIUM} is missing: `apt-get install chromium` (Debian's build; playwright's fails here)"
        )
    return node


# --- the Node unit tests ------------------------------------------------------------


def test_node_unit_tests() -> None:
    node = _node()
    proc = subprocess.run(
        [node, "--test", "test/"], cwd=CLIENT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"node --test failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert "# fail 0" in proc.stdout


# --- servers and expected audio --------------------------------------------------------


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _serve(*flags: str, ready_within_s: float = 60) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--engine", "fake", "--port", str(port), *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + ready_within_s
    while not _ready(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server ({' '.join(flags)}) did not become ready")
        time.sleep(0.1)
    return proc, port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def expected_float(text: str, seed: int) -> np.ndarray:
    """The stream's float32 audio at 24 kHz, exactly as the fake engine makes it."""
    params = SynthesisParams(seed=seed)
    parts = [
        expected_audio(SequenceRequest(seq_id=0, text=seg, params=params, seed_offset=k))
        for k, seg in enumerate(split_segments(text))
    ]
    return np.concatenate(parts)


def expected_pcm16(text: str, seed: int) -> np.ndarray:
    """What a pcm16 player must render: the server's int16 samples / 32768 (exact in float32)."""
    return to_pcm16(expected_float(text, seed)).astype(np.float32) / np.float32(32768)


def capture_opus(port: int, text: str, seed: int) -> tuple[list[bytes], int]:
    """The raw Opus packets of a stream (48 kHz) and ``done.samples``, over a plain WebSocket."""
    packets: list[bytes] = []
    with connect(f"ws://127.0.0.1:{port}/v1/stream", compression=None, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "hello"
        start = {"type": "start", "id": "ref", "text": text, "seed": seed, "format": "opus"}
        ws.send(json.dumps({**start, "sample_rate": OPUS_RATE}))
        while True:
            raw = ws.recv(timeout=30)
            if isinstance(raw, bytes):
                packets.append(raw[12:])
                continue
            msg = json.loads(raw)
            assert msg["type"] != "error", msg
            if msg["type"] == "done":
                return packets, int(msg["samples"])


def libopus_decode(packets: list[bytes], total: int) -> np.ndarray:
    """Decode like the protocol says: every packet, drop the pre-skip, keep ``total`` samples."""
    decoder = opuslib.Decoder(OPUS_RATE, 1)
    pcm = b"".join(decoder.decode_float(p, OPUS_RATE // 50) for p in packets)
    decoded = np.frombuffer(pcm, "<f4")
    return decoded[OPUS_PRESKIP_48K : OPUS_PRESKIP_48K + total]


# --- the browser runs --------------------------------------------------------------------

SCENARIOS: list[dict[str, Any]] = [
    {"name": "pcm16", "text": TEXT, "seed": 7, "format": "pcm16"},
    {"name": "f32", "text": SHORT, "seed": 3, "format": "f32"},
    {"name": "opus", "text": TEXT, "seed": 7, "format": "opus"},
    # Abrupt kills (TCP reset from a proxy) of the first two connections, mid-stream.
    {"name": "pcm16-killed", "text": TEXT, "seed": 7, "format": "pcm16", "cutAfterBytes": [30_000, 40_000]},
    {"name": "opus-killed", "text": TEXT, "seed": 7, "format": "opus", "cutAfterBytes": [5_000]},
    # The client's own hook closing the socket (the demo's "drop connection" button).
    {"name": "f32-dropped", "text": TEXT, "seed": 5, "format": "f32", "dropAfterFrames": [40]},
]
#: Played by a server slower than real time: underruns must be counted, audio still exact.
SLOW_SCENARIO: dict[str, Any] = {
    "name": "pcm16-slow-server",
    "text": "A server slower than real time. 慢一点。",
    "seed": 11,
    "format": "pcm16",
    "startThresholdMs": 60,
    "bufferAdvice": False,  # the fixed 60 ms alone: this one is to under-run
}
#: The same on the server's advice (``started.buffer_ms``): the player starts later, and plays through.
#: (Another seed: the same one would be answered from the response cache, all at once.)
ADVISED_SCENARIO: dict[str, Any] = {
    **SLOW_SCENARIO,
    "name": "pcm16-slow-advised",
    "seed": 12,
    "bufferAdvice": True,
}
SLOW_SCENARIOS = (SLOW_SCENARIO, ADVISED_SCENARIO)


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Run every browser scenario once (one Chromium) and return the results by name."""
    node = _require_browser_tools()
    work = tmp_path_factory.mktemp("e2e")
    fast, fast_port = _serve("--voices-dir", str(work / "voices"))  # none of the user's voices
    # 16 tokens (341 ms of audio) per 450 ms step: slower than real time.
    slow, slow_port = _serve("--fake-step-ms", "450")
    keyed, keyed_port = _serve("--api-keys", DEMO_KEY, "--voices-dir", str(work / "voices"))
    servers = [fast, slow, keyed]
    try:
        keyed_url = f"http://127.0.0.1:{keyed_port}"
        screenshots = [
            {"name": "demo", "path": str(work / "demo.png"), "text": TEXT, "format": "auto"},
            # The page of a server with --api-keys, as a user meets it: refused, then the key.
            {"name": "keyed", "server": keyed_url, "apiKey": DEMO_KEY, "text": SHORT, "format": "pcm16"},
            {"name": "wrong-key", "server": keyed_url, "apiKey": "not-the-key", "refused": True},
        ]
        spec = {
            "server": f"http://127.0.0.1:{fast_port}",
            "scenarios": [
                *SCENARIOS,
                *({**s, "server": f"http://127.0.0.1:{slow_port}"} for s in SLOW_SCENARIOS),
            ],
            "screenshots": screenshots,
        }
        (work / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run(
            [node, "e2e/run.mjs", str(work / "spec.json"), str(work / "out.json")],
            cwd=CLIENT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, f"e2e runner failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        out: dict[str, Any] = json.loads((work / "out.json").read_text())
        packets, total = capture_opus(fast_port, TEXT, 7)
        results: dict[str, Any] = {s["name"]: s for s in out["scenarios"]}
        results["_opus_reference"] = libopus_decode(packets, total)
        results["_opus_total"] = total
        results["_demo"] = {shot["name"]: shot for shot in out["screenshots"]}
        results["_screenshot_path"] = work / "demo.png"
        yield results
    finally:
        for proc_ in servers:
            _stop(proc_)


def played(result: dict[str, Any]) -> np.ndarray:
    """The samples the tap recorded, after the scenario finished."""
    assert "failed" not in result, f"{result['failed']}\n" + "\n".join(result.get("logs", []))
    assert result["reason"] == "complete", result["events"]
    samples = np.frombuffer(base64.b64decode(result["samples"]), "<f4")
    assert len(samples) == result["count"]
    return samples


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert len(got) == len(want), f"played {len(got)} samples, the stream has {len(want)}"
    diff = np.flatnonzero(got != want)
    assert diff.size == 0, (
        f"{diff.size} samples differ, first at {diff[0]}: {got[diff[0]]} != {want[diff[0]]}"
    )


def test_pcm16_plays_bit_exact_with_no_underrun(e2e: dict[str, Any]) -> None:
    result = e2e["pcm16"]
    assert_same(played(result), expected_pcm16(TEXT, 7))
    assert (result["format"], result["sampleRate"]) == ("pcm16", 24_000)
    metrics = result["metrics"]
    assert metrics["underruns"] == 0 and metrics["underrunMs"] == 0  # the server is faster than real time
    assert 0 < metrics["timeToFirstFrameMs"] <= metrics["timeToFirstAudioMs"] < 10_000
    assert metrics["reconnects"] == 0 and result["connections"] == 1
    types = [e["type"] for e in result["events"]]
    # "playing" may come before or after "done": the server can finish before the player starts.
    assert types[0] == "started" and types[-1] == "ended"
    assert types.count("done") == 1 and types.count("playing") == 1
    segments = [e["text"] for e in result["events"] if e["type"] == "segment"]
    assert segments == split_segments(TEXT)


def test_f32_plays_bit_exact(e2e: dict[str, Any]) -> None:
    result = e2e["f32"]
    assert_same(played(result), expected_float(SHORT, 3))
    assert result["metrics"]["underruns"] == 0


def test_opus_plays_through_webcodecs_with_the_right_length(e2e: dict[str, Any]) -> None:
    result = e2e["opus"]
    assert result["webcodecs"] and not result["fellBack"]
    assert (result["format"], result["sampleRate"]) == ("opus", OPUS_RATE)
    samples = played(result)
    # Pre-skip dropped and the end trimmed: exactly the stream's length at 48 kHz.
    assert len(samples) == e2e["_opus_total"] == 2 * len(expected_float(TEXT, 7))
    # WebCodecs' decoder is libopus: bit for bit the samples of decoding the packets in Python.
    assert_same(samples, e2e["_opus_reference"])
    assert result["metrics"]["underruns"] == 0


@pytest.mark.parametrize("name", ["pcm16-killed", "f32-dropped", "opus-killed"])
def test_connection_lost_mid_stream_resumes_seamlessly(e2e: dict[str, Any], name: str) -> None:
    result = e2e[name]
    samples = played(result)
    if name == "pcm16-killed":
        assert_same(samples, expected_pcm16(TEXT, 7))
        assert result["killed"] == [30_000, 40_000]  # both connections were reset mid-stream
        assert result["connections"] == 3 and result["metrics"]["reconnects"] == 2
    elif name == "f32-dropped":
        assert_same(samples, expected_float(TEXT, 5))
        assert result["connections"] == 2 and result["metrics"]["reconnects"] == 1
    else:
        # The same packets decoded by one decoder across the resume: equal to the unbroken run.
        assert_same(samples, played(e2e["opus"]))
        assert result["killed"] == [5_000] and result["connections"] == 2
    resumed = [e for e in result["events"] if e["type"] == "resumed"]
    assert len(resumed) == result["metrics"]["reconnects"] and all(e["afterSeq"] >= 0 for e in resumed)
    # Segment marks are reported once each even though a resume may replay them.
    segments = [e["text"] for e in result["events"] if e["type"] == "segment"]
    assert segments == split_segments(TEXT)


def test_underruns_are_counted_and_the_audio_stays_exact(e2e: dict[str, Any]) -> None:
    result = e2e["pcm16-slow-server"]
    assert_same(played(result), expected_pcm16(SLOW_SCENARIO["text"], 11))
    metrics = result["metrics"]
    assert metrics["underruns"] >= 1 and metrics["underrunMs"] > 0
    assert sum(e["type"] == "underrun" for e in result["events"]) == metrics["underruns"]


def test_the_players_start_waits_for_the_servers_advice_and_plays_through(e2e: dict[str, Any]) -> None:
    result = e2e["pcm16-slow-advised"]
    assert_same(played(result), expected_pcm16(ADVISED_SCENARIO["text"], ADVISED_SCENARIO["seed"]))
    started = next(e for e in result["events"] if e["type"] == "started")
    # The slow server (16 tokens of 341 ms a 450 ms step) measured itself slower than real time.
    assert started["expectedRtf"] > 1 and started["bufferMs"] > ADVISED_SCENARIO["startThresholdMs"]
    assert result["metrics"]["underruns"] == 0  # where the fixed 60 ms under-runs (above)


def test_demo_page_speaks_and_shows_its_metrics(e2e: dict[str, Any]) -> None:
    shot = e2e["_demo"]["demo"]
    assert "failed" not in shot, shot
    assert shot["state"] == "finished" and shot["underruns"] == "0" and shot["reconnects"] == "0"
    assert shot["ttfa"].endswith(" ms") and shot["format"].startswith("opus")
    assert shot["segments"] == len(split_segments(TEXT))
    assert not shot["logs"], shot["logs"]
    png = Path(e2e["_screenshot_path"]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # The voice list is hello's: the same names as every port's (the engine's, OpenAI's).
    assert shot["voices"] == [*FAKE_VOICES, *OPENAI_VOICES]
    # The test engine has no weights: no random-weights banner.
    assert shot["banner"]["hidden"] and shot["banner"]["weights"] == "none"
    assert shot["connection"] == "connected"


def test_the_demo_asks_for_the_api_key_and_plays_once_it_is_typed(e2e: dict[str, Any]) -> None:
    """``--api-keys``: the page is refused (1008) and says so; with the key typed, it plays."""
    shot = e2e["_demo"]["keyed"]
    assert "failed" not in shot, shot
    assert shot["beforeKey"] == {
        "connection": "this server needs an API key: type it, then Connect",
        "playDisabled": True,
    }
    assert shot["connection"] == "connected with the API key"
    assert shot["state"] == "finished" and shot["format"] == "pcm16 24 kHz"
    assert shot["segments"] == len(split_segments(SHORT)) and shot["ttfa"].endswith(" ms")
    assert not shot["logs"], shot["logs"]


def test_the_demo_says_when_its_api_key_is_refused(e2e: dict[str, Any]) -> None:
    shot = e2e["_demo"]["wrong-key"]
    assert "failed" not in shot, shot
    assert shot["connection"] == "the server refused this API key: check it, then Connect"
    assert shot["playDisabled"] and shot["voices"] == ["default"]  # never connected: the page's placeholder


def _run_demo(node: str, work: Path, server: str, shots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (work / "spec.json").write_text(json.dumps({"server": server, "scenarios": [], "screenshots": shots}))
    run = subprocess.run(
        [node, "e2e/run.mjs", str(work / "spec.json"), str(work / "out.json")],
        cwd=CLIENT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, f"e2e runner failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    result: list[dict[str, Any]] = json.loads((work / "out.json").read_text())["screenshots"]
    return result


@pytest.mark.model
def test_a_dev_model_shows_the_random_weights_banner(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The tiny random-weight model (``hello.weights`` = ``random``): the page says it plays noise."""
    node = _require_browser_tools()
    model = ["--engine", "chattts", "--model-dir", str(tiny_model_dir), "--device", "cpu"]
    flags = ["--dtype", "float32", "--no-warmup", "--voices-dir", str(tmp_path / "v")]
    proc, port = _serve(*model, *flags, ready_within_s=240)
    try:
        [shot] = _run_demo(node, tmp_path, f"http://127.0.0.1:{port}", [{"name": "dev", "play": False}])
    finally:
        _stop(proc)
    assert "failed" not in shot, shot
    banner = shot["banner"]
    assert not banner["hidden"] and banner["weights"] == "random", banner
    assert banner["text"].startswith("Random weights: this is not speech.")
    assert "--dev-model" in banner["text"]
    assert shot["voices"] == ["default", *OPENAI_VOICES]  # ChatTTS names one voice, then OpenAI's
    assert not shot["logs"], shot["logs"]


def test_the_screenshot_script_shoots_the_demo_as_it_plays_after_a_resume(tmp_path: Path) -> None:
    """``scripts/screenshot_demo.py`` (what refreshes ``docs/screenshot-demo.png``) works as documented."""
    _require_browser_tools()
    out = tmp_path / "shot.png"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "screenshot_demo.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["screenshot"] == str(out) and (said["state"], said["reconnects"]) == ("playing", "1")
    png = out.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


# --- CORS: a page on another origin calls the HTTP API (issue 25) -------------------------------


def test_a_page_on_an_allowed_origin_calls_the_http_api_and_another_cannot(tmp_path: Path) -> None:
    """The demo's own origin (the WebSocket port) is allowed; ``localhost`` for the same port is not."""
    node = _require_browser_tools()
    from tests.integration.test_voices import TRANSCRIPT, encoded, recording

    port = free_port()
    allowed, refused = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
    flags = ["--api-keys", "page-key", "--allowed-origins", allowed, "--voices-dir", str(tmp_path / "voices")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--engine", "fake", "--port", str(port), *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not _ready(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        spec = {
            "pages": [f"{allowed}/health", f"{refused}/health"],
            "api": f"http://127.0.0.1:{port + 1}/v1",
            "key": "page-key",
            "wav": base64.b64encode(encoded(recording())).decode(),
            "transcript": TRANSCRIPT,
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        run = subprocess.run(
            [node, "e2e/cors.mjs", str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
            cwd=CLIENT,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert run.returncode == 0, f"cors runner failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
        out = json.loads((tmp_path / "out.json").read_text())
    finally:
        _stop(proc)
    ok = out[f"{allowed}/health"]
    assert ok["speech"]["status"] == 200 and ok["speech"]["bytes"] > 0, ok
    assert ok["upload"]["status"] == 200 and ok["upload"]["id"].startswith("voice_"), ok
    assert ok["delete"] == {"status": 200}, ok
    other = out[f"{refused}/health"]
    assert all(
        "Failed to fetch" in other[call].get("error", "") for call in ("speech", "upload", "delete")
    ), other
