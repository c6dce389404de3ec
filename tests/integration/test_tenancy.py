"""Tenancy (issue #25, finding 11): with API keys, streams and voices belong to the key that made them.

Over the real WebSocket and HTTP ports: another key cannot resume a stream (``unknown_stream``,
as for a token the server does not hold), nor list, speak with or delete a voice (not listed,
``unsupported`` as an unknown voice, 404). Keys named under one ``[tenant]`` in the keys file
share what they make. Without keys, one user: everything is shared, as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from websockets.asyncio.client import connect

from server.app import App
from server.config import Settings
from server.errors import StartupError
from server.frontends.access import read_api_keys
from tests.integration.test_http_speech import base_url
from tests.integration.test_resume import contiguous_last, read_until_cut
from tests.integration.test_voices import encoded, form, recording, upload
from tests.wsclient import collect, open_client, recv, recv_json, start, url

KEYS_FILE = """\
# one key per line: each key is its own tenant (the format before tenants)
key-alice
key-bob
# a header names a tenant: the keys below it share its streams and voices
[acme]
key-acme-1
key-acme-2
"""
TEXT = "A stream that belongs to whoever started it. 第二句话在这里。And a third sentence."


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def tenancy_app(make_app: Any, tmp_path: Path, *flags: str) -> App:
    keys = tmp_path / "keys"
    keys.write_text(KEYS_FILE)
    app: App = await make_app(
        "--api-keys-file", str(keys), "--voices-dir", str(tmp_path / "voices"), "--resume-ttl-s", "30", *flags
    )
    return app


async def cut_stream(app: App, key: str | None) -> tuple[str, dict[int, bytes]]:
    """Start a stream with ``key``, read a few frames, drop the connection; (token, frames)."""
    headers = bearer(key) if key else {}
    ws, _ = await open_client(app.port, additional_headers=headers)
    await start(ws, id="s", text=TEXT, seed=7)
    got: dict[int, bytes] = {}
    token = await read_until_cut(ws, got, 2)
    assert token is not None
    return token, got


async def resume_answer(app: App, key: str | None, token: str, after_seq: int) -> dict[str, Any]:
    """The first answer to ``resume`` on a new connection with ``key`` (the connection is closed)."""
    headers = bearer(key) if key else {}
    ws, _ = await open_client(app.port, additional_headers=headers)
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": after_seq}))
    answer = await recv_json(ws)
    await ws.close()
    return answer


@pytest.mark.parametrize(
    ("owner", "other", "shared"),
    [("key-alice", "key-bob", False), ("key-acme-1", "key-alice", False), ("key-acme-1", "key-acme-2", True)],
)
async def test_a_stream_is_resumed_only_by_its_tenant(
    make_app: Any, tmp_path: Path, owner: str, other: str, shared: bool
) -> None:
    app = await tenancy_app(make_app, tmp_path, "--fake-step-ms", "20")
    token, got = await cut_stream(app, owner)
    answer = await resume_answer(app, other, token, contiguous_last(got))
    if not shared:
        assert answer["type"] == "error" and answer["code"] == "unknown_stream", answer
        assert answer["stream"] == token and "id" not in answer  # nothing about the stream leaks
    else:
        assert answer["type"] == "resumed", answer
    # Its owner (or a key of the same tenant) still resumes it and gets every frame.
    ws = await connect(url(app.port), compression=None, max_size=None, additional_headers=bearer(owner))
    assert json.loads(await recv(ws))["type"] == "hello"
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": contiguous_last(got)}))
    await read_until_cut(ws, got, None)
    assert -1 in got and set(got) == set(range(-1, json.loads(got[-1])["last_seq"] + 1))


async def voice_ids(app: App, key: str) -> set[str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{base_url(app)}/audio/voices", headers=bearer(key)) as resp,
    ):
        assert resp.status == 200
        return {entry["id"] for entry in (await resp.json())["data"]}


async def http_speech(app: App, key: str, voice: str) -> tuple[int, Any]:
    body = {"model": "chattts", "input": "Speak in my voice.", "voice": voice, "response_format": "pcm"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base_url(app)}/audio/speech", json=body, headers=bearer(key)) as resp,
    ):
        raw = await resp.read()
        return resp.status, json.loads(raw) if resp.status != 200 else raw


async def ws_speak(app: App, key: str, voice: str) -> tuple[list[str], Any]:
    """(hello's voices, the stream's log) of a WebSocket stream in ``voice`` with ``key``."""
    ws, hello = await open_client(app.port, additional_headers=bearer(key))
    await start(ws, id="v", text="Speak in my voice.", voice=voice, seed=1)
    log = (await collect(ws, {"v"}))["v"]
    await ws.close()
    return hello["voices"], log


async def test_a_voice_is_listed_spoken_and_deleted_only_by_its_tenant(make_app: Any, tmp_path: Path) -> None:
    app = await tenancy_app(make_app, tmp_path)
    status, voice = await upload(app, form(encoded(recording()), name="alice's"), bearer("key-alice"))
    assert status == 200, voice
    vid = voice["id"]
    status, acme = await upload(app, form(encoded(recording(seed=1)), name="acme's"), bearer("key-acme-1"))
    assert status == 200, acme

    assert vid in await voice_ids(app, "key-alice") and acme["id"] not in await voice_ids(app, "key-alice")
    assert vid not in await voice_ids(app, "key-bob")
    assert acme["id"] in await voice_ids(app, "key-acme-2")  # the same tenant, another key

    voices, log = await ws_speak(app, "key-bob", vid)
    assert vid not in voices
    assert [e["code"] for e in log.errors] == ["unsupported"] and "unknown voice" in log.errors[0]["message"]
    status, answer = await http_speech(app, "key-bob", vid)
    assert status == 400 and answer["error"]["code"] == "unsupported"

    voices, log = await ws_speak(app, "key-alice", vid)
    assert vid in voices and log.done is not None and log.done["reason"] == "complete"
    status, audio = await http_speech(app, "key-alice", vid)
    assert status == 200 and audio

    async with aiohttp.ClientSession() as session:
        async with session.delete(f"{base_url(app)}/audio/voices/{vid}", headers=bearer("key-bob")) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
        assert vid in await voice_ids(app, "key-alice")  # still there
        async with session.delete(f"{base_url(app)}/audio/voices/{vid}", headers=bearer("key-alice")) as resp:
            assert resp.status == 200
    assert vid not in await voice_ids(app, "key-alice")


async def test_a_tenants_voices_survive_a_restart_as_its_own(make_app: Any, tmp_path: Path) -> None:
    app = await tenancy_app(make_app, tmp_path)
    status, voice = await upload(app, form(encoded(recording())), bearer("key-acme-2"))
    assert status == 200
    await app.stop()
    again = await tenancy_app(make_app, tmp_path)
    assert voice["id"] in await voice_ids(again, "key-acme-1")
    assert voice["id"] not in await voice_ids(again, "key-bob")


async def test_without_keys_one_user_shares_everything(make_app: Any, tmp_path: Path) -> None:
    """The single-user default: no keys, no tenants; a presented key is no identity of its own."""
    app: App = await make_app("--voices-dir", str(tmp_path), "--fake-step-ms", "20", "--resume-ttl-s", "30")
    token, got = await cut_stream(app, "made-up-key")
    assert (await resume_answer(app, None, token, contiguous_last(got)))["type"] == "resumed"
    status, voice = await upload(app, form(encoded(recording())), bearer("made-up-key"))
    assert status == 200
    async with aiohttp.ClientSession() as session, session.get(f"{base_url(app)}/audio/voices") as resp:
        assert voice["id"] in {entry["id"] for entry in (await resp.json())["data"]}


def test_the_keys_file_names_tenants_and_refuses_a_bad_header(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEYS_FILE)
    read = read_api_keys(Settings(api_keys="key-cli", api_keys_file=str(keys)))
    assert read == [
        ("key-cli", None),
        ("key-alice", None),
        ("key-bob", None),
        ("key-acme-1", "acme"),
        ("key-acme-2", "acme"),
    ]
    keys.write_text("key-one\n[not a name!]\nkey-two\n")
    with pytest.raises(StartupError) as refused:
        read_api_keys(Settings(api_keys_file=str(keys)))
    assert "line 2" in str(refused.value) and "key-one" not in str(refused.value)
