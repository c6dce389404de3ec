"""Every front end as the hostile-client battery drives it (``test_battery.py``).

One adapter per front end: the WebSocket (``/v1/stream``), OpenAI's HTTP endpoint, ElevenLabs'
WebSocket and REST routes, and Wyoming. Each knows how to put a request on its own wire (with a
raw JSON fragment of the test's choosing spliced in, so that ``1e400`` or 20 000 brackets reach
the server as they are) and how to read its own answer back as an :class:`Answer`. The battery's
cases are written once against this interface; a new front end joins the battery by adding an
adapter to :data:`FRONT_ENDS`, and inherits every case.

Every read here has a deadline (:data:`DEADLINE_S`): an answer that never comes fails the test.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from server.app import App

#: The longest any answer may take on a loaded two-core machine: a bound, not a timing claim.
DEADLINE_S = 30.0
#: ~20 000 levels in ~40 KB: inside --max-message-bytes, far past any decoder's recursion.
DEEP = "[" * 20_000 + "]" * 20_000
LONG_TEXT = "This long text keeps the engine busy for a good while, sentence after sentence. " * 12


@dataclass
class Answer:
    """What a front end answered one request with, in the battery's terms.

    Attributes:
        code: the error code of its refusal (our wire code, or the HTTP status as a string for
            a refusal without one); None when it was served.
        audio: the audio bytes it sent.
        closed: the server closed the connection (after the answer, or instead of one).
        close_code: the WebSocket close code, when there was one.
        message: the refusal's words for a person (empty when served).
    """

    code: str | None = None
    message: str = ""
    audio: bytes = b""
    closed: bool = False
    close_code: int | None = None
    raw: list[Any] = field(default_factory=list)


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes (b"" when it cut the connection with a reset)."""
    async with asyncio.timeout(DEADLINE_S):
        try:
            return await reader.read()
        except ConnectionResetError:
            return b""


async def _http_raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request on a new connection; the response read to the end of the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        data = await _read_to_eof(reader)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _unchunk(body)
    return int(status_line.split()[1]), headers, body


def _unchunk(body: bytes) -> bytes:
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return bytes(out)


def _post(path: str, body: bytes, version: str = "1.1", extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return head.encode() + body


async def trickle_until_closed(port: int, head: bytes, drip: bytes, *, every_s: float = 0.2) -> bytes:
    """Send ``head``, then ``drip`` a byte at a time; return what the server sent once it closed.

    Fails (``TimeoutError``) if the server has not closed within :data:`DEADLINE_S`.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = bytearray()
    try:
        writer.write(head)
        async with asyncio.timeout(DEADLINE_S):
            for i in range(10**6):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(every_s):
                        chunk = await reader.read(65536)
                        if not chunk:
                            return bytes(answer)
                        answer += chunk
                        continue
                try:
                    writer.write(drip[i % len(drip) : i % len(drip) + 1])
                    await writer.drain()
                except ConnectionError:
                    return bytes(answer)
    except ConnectionError:
        return bytes(answer)  # cut without a goodbye
    finally:
        writer.transport.abort()
    raise AssertionError("unreachable")


#: What a client that never reads sends at most; the server must stop reading (or cut the
#: connection) long before: kernel buffers on loopback hold a few MB each way.
FLOOD_BYTES = 64 * 1024 * 1024
#: A write that has not drained in this long: the server stopped reading.
STALLED_S = 3.0
WS_KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def masked_ping() -> bytes:
    """One client-to-server WebSocket ping (FIN, opcode 9, masked, 125 bytes of payload)."""
    mask = b"\x01\x02\x03\x04"
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(b"p" * 125))
    return b"\x89" + bytes([0x80 | 125]) + mask + payload


async def flood_unread(port: int, opening: bytes, unit: bytes, *, expect_head: bytes | None = None) -> str:
    """Send ``opening``, then ``unit`` repeated up to :data:`FLOOD_BYTES`, never reading the answers.

    Returns how it ended: ``"stalled"`` (a write did not drain within :data:`STALLED_S`: the
    server stopped reading) or ``"closed"`` (the server cut the connection). Fails if the
    server took everything: it kept reading while it could not write its answers.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(opening)
        if expect_head is not None:
            async with asyncio.timeout(DEADLINE_S):
                head = await reader.readuntil(b"\r\n\r\n")
            assert expect_head in head.split(b"\r\n")[0], head
        chunk = unit * max(1, (256 * 1024) // len(unit))
        sent = 0
        while sent < FLOOD_BYTES:
            try:
                writer.write(chunk)
                async with asyncio.timeout(STALLED_S):
                    await writer.drain()
            except TimeoutError:
                return "stalled"
            except ConnectionError:
                return "closed"
            sent += len(chunk)
        raise AssertionError(f"the server read {sent} bytes from a client that never read its answers")
    finally:
        writer.transport.abort()


def masked_text(text: str) -> bytes:
    """One client-to-server WebSocket text frame (FIN, opcode 1, masked)."""
    data, mask = text.encode(), b"\x05\x06\x07\x08"
    size = len(data)
    length = bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + size.to_bytes(2, "big")
    return b"\x81" + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


#: A client's close frame (code 1000), masked with a zero mask.
MASKED_CLOSE = b"\x88\x82\x00\x00\x00\x00\x03\xe8"


def _leave(writer: asyncio.StreamWriter, polite: bool) -> None:
    """End a raw connection: a FIN (``polite``) or a reset."""
    if polite:
        writer.close()
    else:
        writer.transport.abort()


def ws_opening(path: str) -> bytes:
    """A WebSocket opening handshake for ``path``, as raw bytes."""
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {WS_KEY}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


class FrontEnd(ABC):
    """One front end as the battery drives it."""

    #: Its name in test ids.
    name: str
    #: ``serve`` flags that switch it on.
    flags: tuple[str, ...] = ()
    #: It speaks HTTP on its port (HTTP/1.0 requests are its own), or upgrades from HTTP.
    http: bool = True

    @abstractmethod
    def port(self, app: App) -> int:
        """Its port."""

    @abstractmethod
    def request(self, text: str, extra: str = "") -> str:
        """A request for ``text`` as raw JSON, with ``extra`` (``"key": value`` JSON) spliced in."""

    def speed(self, number: str) -> str:
        """The raw JSON fragment that asks for speed ``number`` (as written)."""
        return f'"speed": {number}'

    def seed(self, number: str) -> str:
        """The raw JSON fragment that asks for seed ``number`` (as written)."""
        return f'"seed": {number}'

    @abstractmethod
    async def exchange(self, app: App, raw: str) -> Answer:
        """Send one request (raw JSON) on a new connection and read its whole answer."""

    async def speak(self, app: App, text: str = "A normal request.") -> bytes:
        """A normal request's audio (it must be served)."""
        answer = await self.exchange(app, self.request(text))
        assert answer.code is None and answer.audio, (self.name, answer)
        return answer.audio

    @abstractmethod
    async def trickle(self, app: App) -> bytes:
        """Begin a request and send it a byte at a time; return once the server cut it."""

    @abstractmethod
    async def flood_invalid(self, app: App, count: int) -> Answer:
        """``count`` invalid requests in a row (on one connection where the wire has one)."""

    @abstractmethod
    async def leave_mid_turn(self, app: App, *, polite: bool = False) -> None:
        """Start a long request, take its first audio, then leave.

        ``polite``: with the wire's goodbye (a WebSocket close frame, a TCP FIN), as pipecat and
        LiveKit leave on an interruption; otherwise the TCP connection is reset.
        """

    def number_requests(self, number: str) -> list[str]:
        """Requests that carry ``number`` (as written) where this front end reads a number."""
        return [self.request("Hi.", self.speed(number)), self.request("Hi.", self.seed(number))]

    @abstractmethod
    def check_flood(self, answer: Answer) -> None:
        """An invalid flood's answer is this front end's refusal."""

    @abstractmethod
    async def never_read(self, app: App) -> None:
        """Send and send without reading a byte of the answers; return once the server stopped it."""

    @abstractmethod
    async def http10(self, app: App) -> Answer:
        """The request as HTTP/1.0 (as nginx sends it upstream), or what an HTTP/1.0 request gets."""

    @abstractmethod
    def check_http10(self, answer: Answer) -> None:
        """An HTTP/1.0 request's answer is one an HTTP/1.0 client can read."""


# --- the WebSocket (/v1/stream) -----------------------------------------------------------------


class WebSocketFront(FrontEnd):
    """``ws://HOST:PORT/v1/stream``: our own protocol."""

    name = "websocket"

    def port(self, app: App) -> int:
        return app.port

    def request(self, text: str, extra: str = "") -> str:
        more = f", {extra}" if extra else ""
        return f'{{"type": "start", "id": "s", "text": {json.dumps(text)}{more}}}'

    async def exchange(self, app: App, raw: str) -> Answer:
        answer = Answer()
        async with connect(f"ws://127.0.0.1:{app.port}/v1/stream", compression=None, max_size=None) as ws:
            async with asyncio.timeout(DEADLINE_S):
                await ws.recv()  # hello
                await ws.send(raw)
                try:
                    async for message in ws:
                        if isinstance(message, bytes):
                            answer.audio += message[12:]
                            continue
                        body = json.loads(message)
                        answer.raw.append(body)
                        if body["type"] == "error":
                            answer.code, answer.message = body["code"], body.get("message", "")
                            return answer
                        if body["type"] == "done":
                            return answer
                except ConnectionClosed as closed:
                    answer.closed, answer.close_code = True, closed.rcvd.code if closed.rcvd else None
        return answer

    async def trickle(self, app: App) -> bytes:
        head = b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        return await trickle_until_closed(app.port, head, b"X-Slow: yes\r\n")

    async def flood_invalid(self, app: App, count: int) -> Answer:
        answer = Answer()
        async with connect(f"ws://127.0.0.1:{app.port}/v1/stream", compression=None) as ws:
            async with asyncio.timeout(DEADLINE_S):
                await ws.recv()
                try:
                    for _ in range(count):
                        await ws.send('{"type": "no-such-message"}')
                    async for message in ws:
                        body = json.loads(message)
                        answer.raw.append(body)
                        answer.code = body.get("code", answer.code)
                except ConnectionClosed as closed:
                    answer.closed, answer.close_code = True, closed.rcvd.code if closed.rcvd else None
        return answer

    async def leave_mid_turn(self, app: App, *, polite: bool = False) -> None:
        ws = await connect(f"ws://127.0.0.1:{app.port}/v1/stream", compression=None)
        async with asyncio.timeout(DEADLINE_S):
            await ws.recv()
            await ws.send(self.request(LONG_TEXT))
            while not isinstance(await ws.recv(), bytes):
                pass
            if polite:
                await ws.close()
                return
        ws.transport.abort()  # no close frame: the TCP connection just ends

    def check_flood(self, answer: Answer) -> None:
        assert answer.closed and answer.close_code == 1008, answer.close_code
        assert answer.code is not None

    async def never_read(self, app: App) -> None:
        """Pings, never reading the pongs (finding 3)."""
        assert await flood_unread(app.port, ws_opening("/v1/stream"), masked_ping(), expect_head=b" 101 ")

    async def http10(self, app: App) -> Answer:
        request = b"GET /v1/stream HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"
        status, _, body = await _http_raw(app.port, request)
        return Answer(code=str(status), raw=[body])

    def check_http10(self, answer: Answer) -> None:
        # A readable refusal: 4xx, or 505 HTTP Version Not Supported (a WebSocket needs HTTP/1.1).
        assert answer.code is not None and (answer.code.startswith("4") or answer.code == "505"), answer


# --- OpenAI's HTTP endpoint -------------------------------------------------------------------


class OpenAIFront(FrontEnd):
    """``POST /v1/audio/speech`` on the HTTP port."""

    name = "openai"
    path = "/v1/audio/speech"

    def port(self, app: App) -> int:
        assert app.http_port is not None
        return app.http_port

    def request(self, text: str, extra: str = "") -> str:
        more = f", {extra}" if extra else ""
        return f'{{"input": {json.dumps(text)}, "voice": "alloy", "response_format": "pcm"{more}}}'

    def seed(self, number: str) -> str:
        return f'"seed": {number}'

    async def exchange(self, app: App, raw: str) -> Answer:
        status, _, body = await _http_raw(self.port(app), _post(self.path, raw.encode()))
        if status == 200:
            return Answer(audio=body)
        return Answer(code=self.code_of(status, body), message=self.message_of(body), raw=[body])

    @staticmethod
    def code_of(status: int, body: bytes) -> str:
        try:
            error = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            return str(status)
        return str(error.get("code") or error.get("type") or status)

    @staticmethod
    def message_of(body: bytes) -> str:
        try:
            return str(json.loads(body)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return body.decode("utf-8", "replace")

    async def trickle(self, app: App) -> bytes:
        body = self.request("Slowly.").encode()
        head = _post(self.path, b"", extra="").replace(
            b"Content-Length: 0", b"Content-Length: %d" % len(body)
        )
        return await trickle_until_closed(self.port(app), head, body)

    async def flood_invalid(self, app: App, count: int) -> Answer:
        """``count`` malformed bodies on one keep-alive connection; each must get its 400."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port(app))
        answer = Answer()
        try:
            async with asyncio.timeout(DEADLINE_S):
                for _ in range(count):
                    body = b"{not json"
                    writer.write(_post(self.path, body).replace(b"Connection: close\r\n", b""))
                    head = await reader.readuntil(b"\r\n\r\n")
                    status = int(head.split()[1])
                    headers = {
                        k.strip().lower(): v.strip()
                        for k, v in (ln.split(":", 1) for ln in head.decode().split("\r\n")[1:] if ":" in ln)
                    }
                    payload = await reader.readexactly(int(headers.get("content-length", "0")))
                    answer.raw.append(status)
                    answer.code = self.code_of(status, payload)
                    if headers.get("connection", "").lower() == "close":
                        answer.closed = True
                        break
        finally:
            writer.close()
        return answer

    async def leave_mid_turn(self, app: App, *, polite: bool = False) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port(app))
        writer.write(_post(self.path, self.request(LONG_TEXT).encode()))
        async with asyncio.timeout(DEADLINE_S):
            head = await reader.readuntil(b"\r\n\r\n")
            assert b" 200 " in head.split(b"\r\n")[0], head
            assert await reader.read(1)  # the first audio
        _leave(writer, polite)

    def check_flood(self, answer: Answer) -> None:
        assert answer.code in {"bad_request", "invalid_request"}, answer.code
        assert all(status == 400 for status in answer.raw), set(answer.raw)
        assert answer.closed or len(answer.raw) == 300

    async def never_read(self, app: App) -> None:
        """Pipelined requests, never reading the answers."""
        request = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        assert await flood_unread(self.port(app), b"", request)

    async def http10(self, app: App) -> Answer:
        status, headers, body = await _http_raw(
            self.port(app), _post(self.path, self.request("Hello there.").encode(), version="1.0")
        )
        if status != 200:
            return Answer(code=self.code_of(status, body))
        assert "chunked" not in headers.get("transfer-encoding", ""), headers
        return Answer(audio=body)

    def check_http10(self, answer: Answer) -> None:
        assert answer.code is None and len(answer.audio) > 1000, answer.code


# --- ElevenLabs -------------------------------------------------------------------------------


class ElevenLabsRestFront(OpenAIFront):
    """``POST /v1/text-to-speech/{voice_id}/stream`` on the HTTP port."""

    name = "elevenlabs-rest"
    path = "/v1/text-to-speech/default/stream?output_format=pcm_24000"

    def request(self, text: str, extra: str = "") -> str:
        more = f", {extra}" if extra else ""
        return f'{{"text": {json.dumps(text)}{more}}}'

    def speed(self, number: str) -> str:
        return f'"voice_settings": {{"speed": {number}}}'

    @staticmethod
    def code_of(status: int, body: bytes) -> str:
        try:
            detail = json.loads(body)["detail"]
        except (ValueError, KeyError, TypeError):
            return str(status)
        return str(detail.get("status") or status)

    @staticmethod
    def message_of(body: bytes) -> str:
        try:
            return str(json.loads(body)["detail"]["message"])
        except (ValueError, KeyError, TypeError):
            return body.decode("utf-8", "replace")


class ElevenLabsSocketFront(FrontEnd):
    """``/v1/text-to-speech/{voice_id}/multi-stream-input``: contexts of text in, audio out."""

    name = "elevenlabs-ws"
    path = "/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"

    def port(self, app: App) -> int:
        assert app.http_port is not None
        return app.http_port

    def url(self, app: App) -> str:
        return f"ws://127.0.0.1:{self.port(app)}{self.path}"

    def request(self, text: str, extra: str = "") -> str:
        more = f", {extra}" if extra else ""
        return f'{{"text": {json.dumps(text)}, "context_id": "c", "flush": true{more}}}'

    def speed(self, number: str) -> str:
        return f'"voice_settings": {{"speed": {number}}}'

    async def exchange(self, app: App, raw: str) -> Answer:
        answer = Answer()
        async with aiohttp.ClientSession() as session, session.ws_connect(self.url(app)) as ws:
            await ws.send_str(raw)
            # A bare flush then close_context: the end of a turn as pipecat sends it (a close
            # without the bare flush is an interruption, which cancels the turn).
            await ws.send_str('{"text": "", "context_id": "c", "flush": true}')
            await ws.send_str('{"context_id": "c", "close_context": true}')
            async with asyncio.timeout(DEADLINE_S):
                async for message in ws:
                    if message.type != aiohttp.WSMsgType.TEXT:
                        break
                    body = json.loads(message.data)
                    answer.raw.append(body)
                    if body.get("audio"):
                        answer.audio += base64.b64decode(body["audio"])
                    if "error" in body:
                        answer.code, answer.message = body["error"], body.get("message", "")
                    if body.get("isFinal") is True:
                        break
            if ws.closed:
                answer.closed, answer.close_code = True, ws.close_code
        return answer

    async def trickle(self, app: App) -> bytes:
        head = f"GET {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
        return await trickle_until_closed(self.port(app), head, b"X-Slow: yes\r\n")

    async def flood_invalid(self, app: App, count: int) -> Answer:
        answer = Answer()
        async with aiohttp.ClientSession() as session, session.ws_connect(self.url(app)) as ws:
            async with asyncio.timeout(DEADLINE_S):
                for _ in range(count):
                    if ws.closed:
                        break
                    with contextlib.suppress(ConnectionError):
                        await ws.send_str("{not json")
                async for message in ws:
                    if message.type != aiohttp.WSMsgType.TEXT:
                        break
                    body = json.loads(message.data)
                    answer.raw.append(body)
                    answer.code = body.get("error", answer.code)
            answer.closed, answer.close_code = ws.closed, ws.close_code
        return answer

    async def leave_mid_turn(self, app: App, *, polite: bool = False) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port(app))
        writer.write(ws_opening(self.path))
        writer.write(masked_text(json.dumps({"text": LONG_TEXT, "context_id": "c", "flush": True})))
        async with asyncio.timeout(DEADLINE_S):
            seen = b""
            while b'"audio"' not in seen:
                chunk = await reader.read(65536)
                assert chunk, "closed before any audio"
                seen = seen[-16:] + chunk
        if polite:
            writer.write(MASKED_CLOSE)  # a close frame (1000), then the FIN, as a client library leaves
        _leave(writer, polite)

    def number_requests(self, number: str) -> list[str]:
        return [self.request("Hi.", self.speed(number))]

    def check_flood(self, answer: Answer) -> None:
        assert answer.closed and answer.close_code == 1008, answer.close_code  # as /v1/stream (finding 9)
        assert answer.code == "bad_request"

    async def never_read(self, app: App) -> None:
        """Pings, never reading the pongs."""
        opening = ws_opening(self.path)
        assert await flood_unread(self.port(app), opening, masked_ping(), expect_head=b" 101 ")

    async def http10(self, app: App) -> Answer:
        request = f"GET {self.path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode()
        status, _, body = await _http_raw(self.port(app), request)
        return Answer(code=str(status), raw=[body])

    def check_http10(self, answer: Answer) -> None:
        # A readable refusal: 4xx, or 505 HTTP Version Not Supported (a WebSocket needs HTTP/1.1).
        assert answer.code is not None and (answer.code.startswith("4") or answer.code == "505"), answer


# --- Wyoming -----------------------------------------------------------------------------------


class WyomingFront(FrontEnd):
    """The Wyoming TCP port (Home Assistant): events in, ``audio-chunk`` events out."""

    name = "wyoming"
    flags = ("--wyoming-port", "-1")
    http = False

    def port(self, app: App) -> int:
        assert app.wyoming_port is not None
        return app.wyoming_port

    def request(self, text: str, extra: str = "") -> str:
        more = f", {extra}" if extra else ""
        return f'{{"type": "synthesize", "data": {{"text": {json.dumps(text)}{more}}}}}'

    def speed(self, number: str) -> str:
        return f'"voice": {{"name": "default", "speaker": {number}}}'

    def seed(self, number: str) -> str:
        return f'"seed": {number}'

    async def exchange(self, app: App, raw: str) -> Answer:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port(app))
        answer = Answer()
        try:
            writer.write(raw.encode() + b"\n")
            async with asyncio.timeout(DEADLINE_S):
                while True:
                    line = await reader.readline()
                    if not line:
                        answer.closed = True
                        break
                    header = json.loads(line)
                    data = header.get("data") or {}
                    if header.get("data_length"):
                        data = json.loads(await reader.readexactly(header["data_length"]))
                    payload = await reader.readexactly(header.get("payload_length") or 0)
                    answer.raw.append(header["type"])
                    if header["type"] == "audio-chunk":
                        answer.audio += payload
                    elif header["type"] == "error":
                        answer.code, answer.message = data.get("code", "error"), data.get("text", "")
                    elif header["type"] == "audio-stop":
                        break
                    if header["type"] == "error":
                        answer.closed = not await reader.read()
                        break
        finally:
            writer.close()
        return answer

    async def trickle(self, app: App) -> bytes:
        return await trickle_until_closed(self.port(app), b'{"type": "synthe', b'size", "data": {}}')

    async def flood_invalid(self, app: App, count: int) -> Answer:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port(app))
        answer = Answer()
        try:
            with contextlib.suppress(ConnectionError):
                for _ in range(count):
                    writer.write(b'{"type": 5}\n')
                await writer.drain()
            data = await _read_to_eof(reader)
            answer.closed = True
            answer.code = "error" if b'"error"' in data else None
            answer.raw.append(data[:200])
        finally:
            writer.close()
        return answer

    async def leave_mid_turn(self, app: App, *, polite: bool = False) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port(app))
        writer.write(self.request(LONG_TEXT).encode() + b"\n")
        async with asyncio.timeout(DEADLINE_S):
            while b"audio-chunk" not in await reader.readline():
                pass
        _leave(writer, polite)

    def number_requests(self, number: str) -> list[str]:
        return [f'{{"type": "synthesize", "data_length": {number}}}']

    def check_flood(self, answer: Answer) -> None:
        # Refused at the first invalid event, then closed; the error event may be lost to the
        # reset of a connection closed with 299 more events unread (that is the point).
        assert answer.closed, answer

    async def never_read(self, app: App) -> None:
        """``describe`` after ``describe``, never reading the ``info`` answers."""
        assert await flood_unread(self.port(app), b"", b'{"type": "describe"}\n')

    async def http10(self, app: App) -> Answer:
        """An HTTP/1.0 request on the Wyoming port is no event: an error, then the close."""
        return await self.exchange(app, "POST / HTTP/1.0")

    def check_http10(self, answer: Answer) -> None:
        assert answer.code is not None and answer.closed, answer


FRONT_ENDS: tuple[FrontEnd, ...] = (
    WebSocketFront(),
    OpenAIFront(),
    ElevenLabsSocketFront(),
    ElevenLabsRestFront(),
    WyomingFront(),
)
