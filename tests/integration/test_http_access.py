"""Who reaches the HTTP API and what is written about it (issue 25: 7, 13), through real sockets.

API keys given as ``?api_key=`` never reach the log (the server as a user runs it, its
stderr read whole); CORS: a preflight from an allowed origin is answered with the
``Access-Control-Allow-*`` headers, so a page there can call the speech endpoint and upload a
voice (and read the answers), while a disallowed origin gets no allow header at all.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
from websockets.asyncio.client import connect

from server.app import App
from tests.integration.conftest import MakeApp
from tests.integration.test_http_speech import base_url
from tests.integration.test_voices import encoded, form, recording
from tests.serverproc import free_port, spawn_server, wait_ready
from tests.wsclient import recv, url

KEY = "sk-never-logged-4f1c"
WRONG = "sk-wrong-never-logged-9e2d"
APP = "https://app.example"
EVIL = "https://evil.example"


# --- 7. API keys are never logged --------------------------------------------------------------


async def test_api_keys_in_the_query_never_reach_the_log() -> None:
    port = free_port()
    flags = ("--engine", "fake", "--port", str(port), "--api-keys", KEY, "--log-level", "debug")
    proc = await spawn_server(*flags, env={**os.environ}, stderr=asyncio.subprocess.PIPE)
    try:
        await wait_ready(port, proc)
        http = f"http://127.0.0.1:{port + 1}"
        async with aiohttp.ClientSession() as session:
            for target, status in (
                (f"/v1/models?api_key={KEY}", 200),
                (f"/v1/models?x=1&api%5Fkey={KEY}", 200),  # the name percent-encoded: still the key
                (f"/v1/audio/voices?api_key={WRONG}", 401),
                (f"/v1/no-such-route?api_key={KEY}", 404),
            ):
                async with session.get(http + target) as resp:
                    assert resp.status == status, target
            body = {"input": "Logged without its key.", "response_format": "pcm"}
            async with session.post(f"{http}/v1/audio/speech?api_key={KEY}", json=body) as resp:
                assert resp.status == 200 and await resp.read()
        # A request line too long: aiohttp's error quotes its start, the key with it.
        reader, writer = await asyncio.open_connection("127.0.0.1", port + 1)
        writer.write(f"GET /v1/models?api_key={KEY}&pad={'a' * 9000} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        async with asyncio.timeout(30):
            assert (await reader.read()).startswith(b"HTTP/1.0 400")
        writer.close()
        ws = await connect(url(port) + f"?api_key={KEY}", compression=None)
        assert '"hello"' in str(await recv(ws))
        await ws.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        async with asyncio.timeout(30):
            log = (await proc.stderr.read()).decode()
            await proc.wait()
    assert KEY not in log and WRONG not in log
    # A client's malformed request is one line, not a traceback.
    assert "Traceback" not in log
    assert "Error handling request from 127.0.0.1: 400 Got more than 8190 bytes" in log, log
    # The access log has the requests, with the keys cut out.
    assert '"GET /v1/models?api_key=[redacted] HTTP/1.1" 200' in log, log
    assert '"GET /v1/models?x=1&api_key=[redacted] HTTP/1.1" 200' in log
    assert '"GET /v1/audio/voices?api_key=[redacted] HTTP/1.1" 401' in log
    assert '"POST /v1/audio/speech?api_key=[redacted] HTTP/1.1" 200' in log


# --- 13. CORS ------------------------------------------------------------------------------------


async def preflight(app: App, path: str, method: str, origin: str) -> aiohttp.ClientResponse:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    async with (
        aiohttp.ClientSession() as session,
        session.options(base_url(app) + path, headers=headers) as resp,
    ):
        await resp.read()
        return resp


def allow_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("access-control-allow")}


async def test_a_preflight_from_an_allowed_origin_is_answered_and_the_page_reads_the_answers(
    make_app: MakeApp, tmp_path: Path
) -> None:
    app = await make_app("--api-keys", KEY, "--allowed-origins", APP, "--voices-dir", str(tmp_path))
    for path, method in (
        ("/audio/speech", "POST"),
        ("/audio/voices", "POST"),
        ("/audio/voices/v1", "DELETE"),
    ):
        resp = await preflight(app, path, method, APP)
        assert resp.status == 204, (path, resp.status)
        allowed = allow_headers(resp)
        assert allowed["access-control-allow-origin"] == APP
        assert method in allowed["access-control-allow-methods"]
        assert {"authorization", "content-type"} <= {
            h.strip().lower() for h in allowed["access-control-allow-headers"].split(",")
        }
        assert "Origin" in resp.headers.getall("Vary")
    page = {"Origin": APP, "Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=page) as session:
        body = {"input": "Spoken for a page.", "response_format": "pcm"}
        async with session.post(base_url(app) + "/audio/speech", json=body) as resp:
            assert resp.status == 200 and await resp.read()
            assert resp.headers["Access-Control-Allow-Origin"] == APP  # streamed, and readable
        async with session.post(base_url(app) + "/audio/voices", data=form(encoded(recording()))) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Access-Control-Allow-Origin"] == APP
        async with session.get(
            base_url(app) + "/audio/voices", headers={"Authorization": "Bearer no"}
        ) as resp:
            assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == APP  # errors too


async def test_a_disallowed_origin_gets_no_allow_headers(make_app: MakeApp) -> None:
    app = await make_app("--api-keys", KEY, "--allowed-origins", APP)
    resp = await preflight(app, "/audio/speech", "POST", EVIL)
    assert resp.status == 403 and allow_headers(resp) == {}
    page = {"Origin": EVIL, "Authorization": f"Bearer {KEY}"}
    async with (
        aiohttp.ClientSession(headers=page) as session,
        session.post(base_url(app) + "/audio/speech", json={"input": "No."}) as resp,
    ):
        assert resp.status == 403 and allow_headers(resp) == {}
