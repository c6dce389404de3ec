"""Malformed input on every port is answered with an error, never a crash (issue 25: 1, 8, 9).

Through real sockets against the fake engine: JSON nested ~20 000 levels deep inside the
size limit on the WebSocket, the HTTP API and Wyoming; Wyoming lengths that are no integers;
voice uploads whose parts cannot be read. Each answer is the front end's own error
(``bad_request`` / 400 / an ``error`` event), and the connection, or the next one, still works.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from wyoming.audio import AudioStop
from wyoming.tts import Synthesize

from server.app import App
from tests.integration.conftest import MakeApp
from tests.integration.test_http_speech import assert_openai_error
from tests.integration.test_voices import TRANSCRIPT, encoded, folder_files, form, recording, upload
from tests.integration.test_wyoming import WYOMING, client, until_end
from tests.wsclient import collect, open_client, recv_json, start

#: ~20 000 levels in ~40 KB: inside --max-message-bytes (64 KiB), far past any decoder's recursion.
DEEP = "[" * 20_000 + "]" * 20_000
READ_TIMEOUT_S = 30.0


# --- 1. deeply nested JSON ------------------------------------------------------------------


async def test_deep_json_on_the_websocket_is_bad_request_and_the_connection_stays_usable(app: App) -> None:
    ws, _ = await open_client(app.port)
    for raw in (DEEP, '{"type": "start", "id": "a", "text": "Hi.", "extra": ' + DEEP + "}"):
        assert len(raw) < 64 * 1024
        await ws.send(raw)
        error = await recv_json(ws)
        assert error["type"] == "error" and error["code"] == "bad_request", error
        assert "--max-json-depth" in error["message"]
    await start(ws, id="after", text="Still here.", seed=1)
    log = (await collect(ws, {"after"}))["after"]
    assert log.done is not None and log.done["reason"] == "complete"
    await ws.close()


async def _http_exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, dict[str, str], bytes]:
    """One request and its (Content-Length) response on an open keep-alive connection."""
    writer.write(request)
    async with asyncio.timeout(READ_TIMEOUT_S):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines if line)}
        body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


async def test_deep_json_on_the_http_api_is_400_and_the_connection_stays_usable(app: App) -> None:
    assert app.http_port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", app.http_port)
    body = ('{"input": "Hi.", "voice": ' + DEEP + "}").encode()
    request = (
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    status, headers, answer = await _http_exchange(reader, writer, request)
    error = json.loads(answer)
    assert_openai_error(status, error, "bad_request", None)
    assert "--max-json-depth" in error["error"]["message"]
    assert headers.get("connection", "").lower() != "close"
    # The same connection answers the next request.
    status, _, models = await _http_exchange(reader, writer, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and json.loads(models)["object"] == "list"
    writer.close()
    await writer.wait_closed()


async def wyoming_answer(app: App, raw: bytes) -> dict[str, Any]:
    """Send ``raw`` on a new Wyoming connection: its one ``error`` event's data; then it is closed."""
    assert app.wyoming_port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", app.wyoming_port)
    writer.write(raw)
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            header = json.loads(await reader.readline())
            assert header["type"] == "error", header
            data: dict[str, Any] = json.loads(await reader.readexactly(header["data_length"]))
            assert await reader.read() == b""  # closed
    finally:
        writer.close()
    return data


async def assert_wyoming_serves(app: App) -> None:
    async with client(app) as c:
        await c.write_event(Synthesize("Still serving.").event())
        assert AudioStop.is_type((await until_end(c))[-1].type)


async def test_deep_json_in_a_wyoming_event_is_an_error_event(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING)
    data = ('{"text": ' + DEEP + "}").encode()
    for raw in (
        ('{"type": "synthesize", "data": ' + DEEP + "}\n").encode(),
        json.dumps({"type": "synthesize", "data_length": len(data)}).encode() + b"\n" + data,
    ):
        answer = await wyoming_answer(app, raw)
        assert answer["code"] == "bad_request" and "--max-json-depth" in answer["text"], answer
    await assert_wyoming_serves(app)


# --- 9. Wyoming lengths are integers, parsed strictly -----------------------------------------


@pytest.mark.parametrize("value", ["1e400", "-Infinity", "Infinity", "NaN", "1.5", '"5"', "true", "-1"])
@pytest.mark.parametrize("field", ["payload_length", "data_length"])
async def test_a_wyoming_length_that_is_no_integer_is_an_error_event(
    make_app: MakeApp, field: str, value: str
) -> None:
    app = await make_app(*WYOMING)
    raw = ('{"type": "synthesize", "data": {"text": "Hi."}, "' + field + '": ' + value + "}\n").encode()
    answer = await wyoming_answer(app, raw)
    # Not JSON at all (strict JSON has no NaN or Infinity), or JSON that is no integer of 0 or more.
    named = "JSON is malformed" if value in ("-Infinity", "Infinity", "NaN") else f"$.{field}"
    assert answer["code"] == "bad_request" and named in answer["text"], answer
    await assert_wyoming_serves(app)


# --- 8. voice uploads: every part that cannot be read is a 400 naming it --------------------------


def multipart(*parts: tuple[str, dict[str, str], bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body of (name, extra part headers, content), and its Content-Type."""
    boundary = "b0undary4c0ffee"
    out = bytearray()
    for name, headers, content in parts:
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n'.encode()
        out += b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n" + content + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize(
    ("parts", "param", "reason"),
    [
        (
            [("transcript", {"Content-Type": "text/plain; charset=x-no-such-charset"}, TRANSCRIPT.encode())],
            "transcript",
            "unknown charset 'x-no-such-charset'",
        ),
        (
            [("transcript", {"Content-Type": "text/plain; charset=base64"}, b"aGk=")],
            "transcript",
            "unknown charset 'base64'",  # a codec, but no text encoding
        ),
        (
            [("name", {}, b"n" * 17_000)],
            "name",
            "name: too long: at most 16384 bytes",
        ),
        (
            [("transcript", {"Content-Type": "text/plain; charset=ascii"}, TRANSCRIPT.encode())],
            "transcript",
            "not valid ascii",
        ),
        (
            [("audio_sample", {"Content-Transfer-Encoding": "x-rot13"}, b"RIFF....")],
            "audio_sample",
            "unknown content transfer encoding",
        ),
        (
            [("audio_sample", {"Content-Transfer-Encoding": "base64"}, b"not base64!")],
            "audio_sample",
            "malformed base64",
        ),
    ],
)
async def test_an_upload_part_that_cannot_be_read_is_400_naming_it(
    make_app: MakeApp, tmp_path: Path, parts: list[tuple[str, dict[str, str], bytes]], param: str, reason: str
) -> None:
    app = await make_app("--voices-dir", str(tmp_path))
    recording_part = ("audio_sample", {"Content-Type": "audio/wav"}, encoded(recording()))
    transcript_part = ("transcript", {}, TRANSCRIPT.encode())
    others = [p for p in (recording_part, transcript_part) if p[0] not in {name for name, _, _ in parts}]
    body, content_type = multipart(*others, *parts)
    status, answer = await upload(app, body, headers={"Content-Type": content_type})
    assert_openai_error(status, answer, "bad_request", param)
    assert reason in answer["error"]["message"], answer
    assert folder_files(tmp_path) == []


async def test_a_voice_name_over_256_characters_is_blamed_on_name(make_app: MakeApp, tmp_path: Path) -> None:
    app = await make_app("--voices-dir", str(tmp_path))
    status, answer = await upload(app, form(encoded(recording()), name="n" * 257))
    assert_openai_error(status, answer, "bad_request", "name")
    assert "257 characters" in answer["error"]["message"]
    status, voice = await upload(app, form(encoded(recording()), name="n" * 256))
    assert status == 200 and voice["name"] == "n" * 256
