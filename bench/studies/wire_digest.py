"""Digests of the exact wire bytes of seeded streams, to show a change kept behaviour byte for byte.

Starts ``python -m server serve`` from ``--server-root`` (a checkout: today's tree, or an older
commit's worktree), speaks to it only through its public ports (WebSocket and HTTP), and prints
one SHA-256 per request over every message the server sent (text and binary, in order). Resume
tokens are random by design, so ``token``/``stream`` fields are blanked before hashing, and so are
each Ogg page's serial number (random per stream, RFC 3533) and the CRC that covers it; nothing
else is touched. Run it on two trees and compare:

    python -m bench.studies.wire_digest --server-root . --out a.json
    git worktree add /tmp/old <commit>
    python -m bench.studies.wire_digest --server-root /tmp/old --out b.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
import urllib.request
from pathlib import Path
from typing import Any

import websockets

from tests.serverproc import free_port, wait_ready

TEXT = "你好，欢迎使用语音服务。Hello from ChatTTS, streaming while it speaks. 第二句话在这里。"
WS_REQUESTS: list[dict[str, Any]] = [
    {"format": "pcm16"},
    {"format": "f32", "sample_rate": 48_000},
    {"format": "opus", "sample_rate": 48_000},
    {"format": "ogg", "sample_rate": 16_000},
    {"format": "mp3"},
    {"format": "flac", "sample_rate": 16_000},
    {"format": "mulaw", "sample_rate": 8_000},
    {"format": "pcm16", "voice": "seed:7", "speed": 1.5, "temperature": 0.5, "top_k": 10},
]
HTTP_FORMATS = ["pcm", "wav", "mp3", "opus", "flac", "mulaw"]


def blank_ogg_serials(data: bytes) -> bytes:
    """Ogg pages with their random serial number and its CRC zeroed (every page found in ``data``)."""
    out = bytearray(data)
    at = out.find(b"OggS")
    while at >= 0 and at + 27 <= len(out):
        segments = out[at + 26]
        body = sum(out[at + 27 : at + 27 + segments])
        out[at + 14 : at + 18] = bytes(4)  # serial
        out[at + 22 : at + 26] = bytes(4)  # CRC
        at = out.find(b"OggS", at + 27 + segments + body)
    return bytes(out)


def blank_random(message: str) -> str:
    data = json.loads(message)
    for field in ("token", "stream"):
        if field in data:
            data[field] = "-"
    # The buffer advice is measured (the machine's pace), not made: left out, so that digests
    # stay comparable with the ones taken before the server had it.
    for field in ("expected_rtf", "buffer_ms", "buffer_ms_per_s"):
        data.pop(field, None)
    return json.dumps(data, sort_keys=True)


async def ws_stream(port: int, start: dict[str, Any], incremental: bool) -> str:
    digest = hashlib.sha256()
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None) as ws:
        digest.update(blank_random(str(await asyncio.wait_for(ws.recv(), 30))).encode())  # hello
        if incremental:
            await ws.send(json.dumps({"type": "start", "id": "s", "seed": 42, "incremental": True, **start}))
            for piece in ("你好，欢迎使用", "语音服务。Hello from ", "ChatTTS."):
                await ws.send(json.dumps({"type": "append", "id": "s", "text": piece}))
            await ws.send(json.dumps({"type": "end", "id": "s"}))
        else:
            await ws.send(json.dumps({"type": "start", "id": "s", "text": TEXT, "seed": 42, **start}))
        async with asyncio.timeout(120):
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    digest.update(blank_ogg_serials(message) if start["format"] == "ogg" else message)
                    continue
                digest.update(blank_random(message).encode())
                if json.loads(message).get("type") in ("done", "error"):
                    break
    return digest.hexdigest()


def http_speech(port: int, fmt: str) -> str:
    body = json.dumps(
        {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": fmt, "seed": 42}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/audio/speech", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        body = response.read()
        return hashlib.sha256(blank_ogg_serials(body) if fmt == "opus" else body).hexdigest()


async def digests(root: Path, engine_flags: list[str]) -> dict[str, str]:
    port, http_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server", "serve", "--port", str(port), "--http-port", str(http_port),
        "--cache-bytes", "0", *engine_flags, cwd=root, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await wait_ready(port, proc, timeout_s=300)
        out = {}
        for start in WS_REQUESTS:
            out["ws " + json.dumps(start, sort_keys=True)] = await ws_stream(port, start, incremental=False)
        out["ws incremental pcm16"] = await ws_stream(port, {"format": "pcm16"}, incremental=True)
        for fmt in HTTP_FORMATS:
            out[f"http {fmt}"] = await asyncio.to_thread(http_speech, http_port, fmt)
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 60)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--server-root", type=Path, default=Path("."))
    parser.add_argument("--engines", default="fake,tiny", help="fake and/or tiny (the random-weight model)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    flags = {"fake": ["--engine", "fake"], "tiny": ["--dev-model", "tiny", "--dtype", "float32"]}
    result = {}
    for name in args.engines.split(","):
        result[name] = asyncio.run(digests(args.server_root.resolve(), flags[name]))
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
