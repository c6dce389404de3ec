#!/usr/bin/env python3
"""Refresh docs/screenshot-demo.png: the demo page mid-stream, just after a dropped connection resumed.

    .venv/bin/python scripts/screenshot_demo.py            # writes docs/screenshot-demo.png
    .venv/bin/python scripts/screenshot_demo.py --out x.png

It starts a test-engine server paced at about real time (``--fake-step-ms 250``, so the page is
caught while it plays), drives the page in headless Chromium with the browser tests' runner
(``client_js/e2e/run.mjs``): play a text, press "Drop connection" after 0.4 s, shoot from
1.4 s on, once the page plays again after its reconnect.
It needs what ``scripts/setup.sh --dev`` installs: node, Debian's ``chromium``,
``client_js/node_modules`` and a Chinese font (``fonts-noto-cjk``). It exits 1, writing
nothing, when the page did not play and resume.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "screenshot-demo.png"
TEXT = (
    "你好，欢迎使用语音服务。今天天气很好！This is a streaming test with a longer text, "
    "so that the connection can drop in the middle. Does it work? 最后一句话。"
)


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ready(port: int) -> bool:
    """Whether the server on ``port`` answers ``/ready`` with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def shoot(out: Path, work: Path) -> dict[str, object]:
    """Serve, drive the page, return what the runner saw (the PNG is at ``out`` if it worked)."""
    port = free_port()
    flags = ["--engine", "fake", "--host", "127.0.0.1", "--port", str(port), "--fake-step-ms", "250"]
    server = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", *flags, "--voices-dir", str(work / "voices")],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the test-engine server did not become ready")
            time.sleep(0.1)
        shot = {"name": "docs", "path": str(out), "text": TEXT, "format": "pcm16"}
        shot |= {"dropAfterMs": 400, "shotAfterMs": 1400, "shotWhen": {"state": "playing", "reconnects": "1"}}
        spec = {"server": f"http://127.0.0.1:{port}", "scenarios": [], "screenshots": [shot]}
        (work / "spec.json").write_text(json.dumps(spec))
        run = subprocess.run(
            ["node", "e2e/run.mjs", str(work / "spec.json"), str(work / "out.json")],
            cwd=ROOT / "client_js",
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if run.returncode != 0:
            raise SystemExit(f"the browser runner failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        result: dict[str, object] = json.loads((work / "out.json").read_text())["screenshots"][0]
        return result
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    """Shoot into a temporary file; only a page that played and resumed replaces ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SCREENSHOT, help=f"the PNG (default {SCREENSHOT})")
    args = parser.parse_args()
    out: Path = args.out.resolve()
    fonts = subprocess.run(["fc-list", ":lang=zh"], capture_output=True, text=True, check=False)
    if not fonts.stdout.strip():
        print("warning: no Chinese font, the text will show as boxes (apt-get install fonts-noto-cjk)")
    with tempfile.TemporaryDirectory(prefix="screenshot-demo-") as tmp:
        work = Path(tmp)
        taken = work / "demo.png"  # moved into place only once the page did what the picture shows
        result = shoot(taken, work)
        if "failed" in result or result.get("state") != "playing" or result.get("reconnects") != "1":
            raise SystemExit(f"the page did not play and resume as the picture should show: {result}")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(taken.read_bytes())
    print(json.dumps({"screenshot": str(out), **{k: result[k] for k in ("state", "reconnects", "ttfa")}}))


if __name__ == "__main__":
    main()
