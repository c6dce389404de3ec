"""Issue 42, finding 1: an ElevenLabs socket closed mid-turn frees its streams at once.

pipecat and LiveKit close their ElevenLabs socket on every interruption, while a context is
still speaking. Before, the socket's handler awaited its pump tasks before it freed its
contexts, and aiohttp's cancellation of the handler (its client is gone) skipped the freeing:
every such stream kept generating into a buffer nobody read, stayed in
``chattts_active_streams`` for good, and every drain then ran to its timeout. These tests run
a real server process (fake engine) and real clients: a clean close and an abrupt TCP close,
each mid-turn, then read ``/metrics`` until the streams are gone and send SIGTERM; LiveKit's
own plugin closing its streams at their first audio. Every other front end's client cut off
mid-turn is a case of the hostile-client battery (``tests/integration/test_battery.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request

import aiohttp
import pytest
from livekit.plugins import elevenlabs as lk_elevenlabs
from websockets.asyncio.client import connect

from tests.integration.conftest import MakeApp, wait_until
from tests.serverproc import free_port, spawn_server, wait_ready

LONG = "A long sentence that keeps the fake engine busy for a good while yet. " * 12
DRAIN_S = 60.0
#: The streams must be gone this soon after the last client left (far under the drain timeout).
GONE_WITHIN_S = 15.0
_ACTIVE = re.compile(r"^chattts_active_streams ([0-9.e+]+)$", re.MULTILINE)


def _active_streams(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    match = _ACTIVE.search(text)
    assert match is not None, "no chattts_active_streams in /metrics"
    return float(match.group(1))


async def _wait_active(port: int, want: float, timeout_s: float) -> float:
    """Poll ``chattts_active_streams`` until it is ``want``; returns it (the last value on timeout)."""
    value = -1.0
    try:
        async with asyncio.timeout(timeout_s):
            while (value := await asyncio.to_thread(_active_streams, port)) != want:
                await asyncio.sleep(0.05)
    except TimeoutError:
        pass
    return value


def _ws_url(port: int) -> str:
    # The HTTP port is the WebSocket port + 1 by default.
    return _eleven_url(port + 1)


def _eleven_url(http_port: int) -> str:
    return f"ws://127.0.0.1:{http_port}/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"


def _open_turn(context: str) -> list[str]:
    """What pipecat sends for one turn: the context's opening, a long text, its flush."""
    return [
        json.dumps({"text": " ", "context_id": context, "voice_settings": {"speed": 1.0}}),
        json.dumps({"text": LONG, "context_id": context}),
        json.dumps({"context_id": context, "flush": True}),
    ]


async def _aiohttp_turn_then_close(session: aiohttp.ClientSession, port: int, n: int) -> None:
    """A context speaking (two, every other socket), then a clean close at its first audio."""
    async with session.ws_connect(_ws_url(port)) as ws:
        contexts = [f"c{n}", f"d{n}"] if n % 2 else [f"c{n}"]
        for context in contexts:
            for message in _open_turn(context):
                await ws.send_str(message)
        async with asyncio.timeout(30):
            while "audio" not in json.loads((await ws.receive()).data):
                pass
    # leaving the block closed the socket mid-turn


async def _websockets_turn_then_abort(port: int, n: int, *, http_port: int | None = None) -> None:
    """The same turn from another client library, then the TCP connection cut (no close frame)."""
    ws = await connect(_ws_url(port) if http_port is None else _eleven_url(http_port), compression=None)
    try:
        for message in _open_turn(f"x{n}"):
            await ws.send(message)
        async with asyncio.timeout(30):
            while "audio" not in json.loads(await ws.recv()):
                pass
    finally:
        ws.transport.abort()
        await ws.wait_closed()


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_a_socket_closed_mid_turn_frees_its_streams_and_the_drain_does_not_wait(how: str) -> None:
    port = free_port()
    flags = ("--engine", "fake", "--port", str(port), "--fake-step-ms", "40", "--cache-bytes", "0")
    proc = await spawn_server(
        *flags, "--drain-timeout-s", str(DRAIN_S), env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        await wait_ready(port, proc)
        if how == "close":
            async with aiohttp.ClientSession() as session:
                for n in range(6):
                    await _aiohttp_turn_then_close(session, port, n)
        else:
            for n in range(6):
                await _websockets_turn_then_abort(port, n)
        left = await _wait_active(port, 0.0, GONE_WITHIN_S)
        assert left == 0.0, f"{left:g} streams still active {GONE_WITHIN_S:g} s after their clients left"

        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(DRAIN_S + 30):
            code = await proc.wait()
        took = time.monotonic() - signalled
        assert code == 0
        assert took < DRAIN_S / 2, f"exited {took:.1f} s after SIGTERM: the drain waited for leaked streams"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# --- LiveKit's own ElevenLabs plugin, its streams closed mid-turn ------------------------------

SLOW = ("--fake-step-ms", "200", "--segment-lookahead", "0", "--cache-bytes", "0")
ROUNDS = 20


async def test_livekit_streams_closed_mid_turn_leave_no_stream(make_app: MakeApp) -> None:
    """LiveKit's plugin, unchanged: each round speaks a long text; the agent closes it at its first audio."""
    app = await make_app(*SLOW)
    async with aiohttp.ClientSession() as session:
        for _ in range(ROUNDS):
            tts = lk_elevenlabs.TTS(
                api_key="unused",
                base_url=f"http://127.0.0.1:{app.http_port}/v1",
                voice_id="default",
                encoding="pcm_24000",
                http_session=session,
            )
            stream = tts.stream()
            stream.push_text(LONG)
            stream.flush()
            async with asyncio.timeout(30):
                await anext(aiter(stream))  # its first audio: the turn is under way
            await stream.aclose()
            await tts.aclose()
            await wait_until(lambda: app.active_streams == 0, timeout=GONE_WITHIN_S)
