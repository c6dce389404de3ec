"""The chaos soak's hostile client: one attack of issue #25 for a few seconds, in its own process.

``python -m bench.chaos.attacks KIND --seconds S --ws-port P --http-port H --wyoming-port W
--key K ...`` runs attack ``KIND`` (one per finding of the issue, :data:`ATTACKS`) against
a server on 127.0.0.1 until ``S`` seconds are over, from the source address
``--source`` (127.0.0.2: another client than the normal ones), then prints one JSON line:
how many probes it made and how many got the answer the issue expects (``expected``). Its
own process, so that its busy loops never delay the normal clients' clocks. Every loop is
bounded (connections, messages, rate) and every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from bench.chaos import sockets
from bench.chaos.guards import GUARD_ATTACKS
from bench.chaos.target import DEEP, LONG, REPLY_S, Tally, Target, quietly_close, read_tokens, reply, until

# --- the attacks, by finding ------------------------------------------------------------------


async def deep_json(t: Target, deadline: float, tally: Tally) -> None:
    """1: nested JSON inside the size limit on every port: ``bad_request`` / 400 / ``error``."""
    async with t.session() as session:
        while until(deadline):
            try:
                ws = await t.ws()
                await ws.send(DEEP)
                answer = await reply(ws)
                await ws.send('{"type": "cancel", "id": "still-there"}')
                usable = (await reply(ws)).get("code") == "bad_request"
                tally.probe(answer.get("code") == "bad_request" and usable, f"ws:{answer.get('code')}")
                await quietly_close(ws)
            except (ConnectionClosed, OSError, TimeoutError) as exc:
                tally.probe(False, f"ws:{type(exc).__name__}")
            try:
                headers = {**t.headers, "Content-Type": "application/json"}
                async with session.post(f"{t.http_url}/v1/audio/speech", data=DEEP, headers=headers) as resp:
                    tally.probe(resp.status == 400, f"http:{resp.status}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                tally.probe(False, f"http:{type(exc).__name__}")
            event = await sockets.wyoming_exchange(t, DEEP.encode() + b"\n")
            tally.probe(event == "error", f"wyoming:{event}")
            await asyncio.sleep(0.1)


async def http_slow(t: Target, deadline: float, tally: Tally) -> None:
    """2: silent, slow-header, endless-chunked and short-bodied HTTP connections: closed by the server."""
    await sockets.hold_http(t, deadline, tally)


async def wyoming_idle(t: Target, deadline: float, tally: Tally) -> None:
    """3: silent Wyoming connections and ``synthesize-start`` without a stop: timed out by the server."""
    await sockets.hold_wyoming(t, deadline, tally)


async def memory(t: Target, deadline: float, tally: Tally) -> None:
    """5: 50 connections × 4 streams of f32 at 48 kHz that are never read."""
    conns: list[ClientConnection] = []
    start = {"type": "start", "text": LONG, "format": "f32", "sample_rate": 48_000}
    try:
        while until(deadline):
            for ws in list(conns):  # an aborted connection is found by writing to it (it reads nothing)
                try:
                    await ws.ping()
                except (ConnectionClosed, OSError):
                    conns.remove(ws)
                    ws.transport.abort()
                    tally.notes["connection dropped by the server"] += 1
            opened = 0
            while len(conns) < 50 and opened < 10 and until(deadline):  # at most 10 new a round
                try:
                    ws = await t.ws(max_queue=1)
                    for k in range(4):
                        await ws.send(json.dumps({**start, "id": f"m{k}"}))
                    conns.append(ws)
                    tally.notes["streams started"] += 4
                except (ConnectionClosed, OSError, TimeoutError) as exc:
                    tally.notes[f"connect:{type(exc).__name__}"] += 1
                opened += 1
            await asyncio.sleep(0.5)
    finally:
        for ws in conns:
            ws.transport.abort()


async def drain(t: Target, deadline: float, tally: Tally) -> None:
    """4: clients that never read while the server drains (the soak sends SIGTERM meanwhile)."""
    conns = []
    try:
        for k in range(4):
            ws = await t.ws(max_queue=1)
            await ws.send(json.dumps({"type": "start", "id": f"d{k}", "text": LONG, "format": "f32"}))
            conns.append(ws)
        conns.append(await t.ws())  # and one idle client
        tally.probe(True, "holding")
        while until(deadline) and not all(c.transport.is_closing() for c in conns):  # noqa: ASYNC110
            await asyncio.sleep(0.2)  # polled: the transports have no event to wait on
    finally:
        for ws in conns:
            ws.transport.abort()


async def resume_past_end(t: Target, deadline: float, tally: Tally) -> None:
    """6: ``resume`` with ``after_seq`` past the stream's end: an error, never silence."""
    while until(deadline):
        try:
            ws = await t.ws()
            await ws.send(json.dumps({"type": "start", "id": "p", "text": "Short one.", "seed": 3}))
            token, last = None, None
            while last is None:
                message = await reply(ws)
                token = message.get("stream", token)
                if message["type"] in ("done", "error"):
                    last = message.get("last_seq", 0)
            await quietly_close(ws)
            ws = await t.ws()
            await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": last + 1000}))
            try:
                answer = await reply(ws)
                tally.probe(answer["type"] == "error", f"{answer['type']}:{answer.get('code')}")
            except TimeoutError:
                tally.probe(False, "silence")
            await quietly_close(ws)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            tally.probe(False, type(exc).__name__)
        await asyncio.sleep(0.2)


async def key_in_query(t: Target, deadline: float, tally: Tally) -> None:
    """7: the API key as ``?api_key=`` (the soak checks the server's log for it afterwards)."""
    async with t.session() as session:
        while until(deadline):
            try:
                async with session.get(f"{t.http_url}/v1/models?api_key={t.key}") as resp:
                    tally.probe(resp.status == 200, f"http:{resp.status}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                tally.probe(False, type(exc).__name__)
            await asyncio.sleep(0.05)


async def voice_uploads(t: Target, deadline: float, tally: Tally) -> None:
    """8: a transcript of unknown charset, audio of unknown transfer encoding, a name too long."""
    async with t.session() as session:
        while until(deadline):
            for param, body, boundary in sockets.bad_uploads():
                headers = {**t.headers, "Content-Type": f"multipart/form-data; boundary={boundary}"}
                try:
                    async with session.post(
                        f"{t.http_url}/v1/audio/voices", data=body, headers=headers
                    ) as resp:
                        answer = await resp.json(content_type=None)
                        named = (answer.get("error") or {}).get("param")
                        tally.probe(resp.status == 400 and named == param, f"{param}:{resp.status}:{named}")
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    tally.probe(False, f"{param}:{type(exc).__name__}")
            await asyncio.sleep(0.2)


async def wyoming_numbers(t: Target, deadline: float, tally: Tally) -> None:
    """9: Wyoming ``payload_length``/``data_length`` of ``1e400`` or ``-Infinity``: an ``error`` event."""
    headers = [
        b'{"type": "synthesize", "data": {"text": "hi"}, "payload_length": 1e400}\n',
        b'{"type": "synthesize", "data": {"text": "hi"}, "data_length": -Infinity}\n',
    ]
    while until(deadline):
        for line in headers:
            event = await sockets.wyoming_exchange(t, line)
            tally.probe(event == "error", f"wyoming:{event}")
        await asyncio.sleep(0.1)


async def invalid_flood(t: Target, deadline: float, tally: Tally) -> None:
    """10: 4 connections × up to 50 000 bad ``cancel`` messages: closed with 1008."""

    async def one() -> None:
        ws = await t.ws()
        code: int | None = None

        async def drain_replies() -> None:
            async for _ in ws:
                pass

        reader = asyncio.create_task(drain_replies())
        try:
            for _ in range(50_000 // 500):
                if not until(deadline):
                    break
                for _ in range(500):
                    await ws.send('{"type": "cancel", "id": "nobody"}')
                await asyncio.sleep(0)  # let the reader see the server's answers (and its close)
        except ConnectionClosed:
            pass
        finally:
            try:
                await asyncio.wait_for(reader, REPLY_S)
            except (TimeoutError, ConnectionClosed):
                reader.cancel()
            code = ws.close_code
            ws.transport.abort()
        tally.probe(code == 1008, f"closed:{code}")

    while until(deadline):
        await asyncio.gather(*(one() for _ in range(4)), return_exceptions=True)


async def tenancy(t: Target, deadline: float, tally: Tally) -> None:
    """11: another tenant's streams (resume) and voice (list, speak, delete): unknown to this key."""
    async with t.session() as session:
        while until(deadline):
            tokens = read_tokens(t.tokens_file)
            for token in tokens[:3]:
                ws = await t.ws()
                await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": -1}))
                answer = await reply(ws)
                tally.probe(
                    answer.get("code") == "unknown_stream", f"resume:{answer['type']}:{answer.get('code')}"
                )
                await quietly_close(ws)
            voice = t.victim_voice
            async with session.get(f"{t.http_url}/v1/audio/voices", headers=t.headers) as resp:
                listed = {v["id"] for v in (await resp.json())["data"]}
                tally.probe(voice not in listed, "list:hidden" if voice not in listed else "list:LEAKED")
            async with session.delete(f"{t.http_url}/v1/audio/voices/{voice}", headers=t.headers) as resp:
                tally.probe(resp.status == 404, f"delete:{resp.status}")
            ws = await t.ws()
            await ws.send(json.dumps({"type": "start", "id": "v", "text": "Borrowed voice.", "voice": voice}))
            answer = await reply(ws)
            tally.probe(answer.get("code") == "unsupported", f"speak:{answer['type']}:{answer.get('code')}")
            await quietly_close(ws)
            await asyncio.sleep(0.2)


async def tag_only(t: Target, deadline: float, tally: Tally) -> None:
    """12: text of only control tags: ``bad_request`` / 400."""
    async with t.session() as session:
        ws = await t.ws()
        try:
            while until(deadline):
                await ws.send(json.dumps({"type": "start", "id": "t", "text": "[laugh][laugh]"}))
                answer = await reply(ws)
                if answer["type"] == "started":  # spoken anyway: read it to its end
                    while answer["type"] != "done":
                        answer = await reply(ws)
                    tally.probe(False, "ws:spoken")
                else:
                    tally.probe(answer.get("code") == "bad_request", f"ws:{answer.get('code')}")
                body = {"model": "tts-1", "input": "[laugh][uv_break]", "response_format": "pcm"}
                async with session.post(
                    f"{t.http_url}/v1/audio/speech", json=body, headers=t.headers
                ) as resp:
                    await resp.read()
                    tally.probe(resp.status == 400, f"http:{resp.status}")
                await asyncio.sleep(0.1)
        finally:
            await quietly_close(ws)


async def cors(t: Target, deadline: float, tally: Tally) -> None:
    """13: a CORS preflight from an allowed origin: answered, with the origin allowed."""
    headers = {
        "Origin": t.origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    async with t.session() as session:
        while until(deadline):
            for path in ("/v1/audio/speech", "/v1/audio/voices"):
                try:
                    async with session.options(f"{t.http_url}{path}", headers=headers) as resp:
                        allowed = resp.headers.get("Access-Control-Allow-Origin") in (t.origin, "*")
                        tally.probe(resp.status < 300 and allowed, f"{path}:{resp.status}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    tally.probe(False, type(exc).__name__)
            await asyncio.sleep(0.1)


Attack = Callable[[Target, float, Tally], Awaitable[None]]
#: Finding number → (name, attack); ``drain`` (4) runs at the end, during the soak's SIGTERM.
ATTACKS: dict[int, tuple[str, Attack]] = {
    1: ("deep_json", deep_json),
    2: ("http_slow", http_slow),
    3: ("wyoming_idle", wyoming_idle),
    4: ("drain", drain),
    5: ("memory", memory),
    6: ("resume_past_end", resume_past_end),
    7: ("key_in_query", key_in_query),
    8: ("voice_uploads", voice_uploads),
    9: ("wyoming_numbers", wyoming_numbers),
    10: ("invalid_flood", invalid_flood),
    11: ("tenancy", tenancy),
    12: ("tag_only", tag_only),
    13: ("cors", cors),
    # Issue #42: the guards every front end shares, and the work a text buys.
    **{14 + i: attack for i, attack in enumerate(GUARD_ATTACKS)},
}
BY_NAME = {name: attack for name, attack in ATTACKS.values()}


async def run(kind: str, target: Target, seconds: float) -> dict[str, Any]:
    """Run one attack for ``seconds``; its tally (an attack that fails outright is noted, not raised)."""
    tally = Tally()
    deadline = time.monotonic() + seconds
    try:
        async with asyncio.timeout(seconds + 30):  # the attack's own loops end at the deadline
            await BY_NAME[kind](target, deadline, tally)
    except Exception as exc:  # counted as a probe that failed: the attack could not go on
        tally.probe(False, f"attack stopped: {type(exc).__name__}: {exc}"[:160])
    return {"kind": kind, "probes": tally.probes, "expected": tally.expected, "notes": dict(tally.notes)}


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.chaos.attacks KIND ...``: print the attack's tally as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m bench.chaos.attacks", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=sorted(BY_NAME))
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--ws-port", type=int, required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--wyoming-port", type=int, required=True)
    p.add_argument("--key", required=True, help="the hostile tenant's API key")
    p.add_argument("--source", default="127.0.0.2", help="the hostile client's source address")
    p.add_argument("--origin", default="https://app.example", help="an origin the server allows")
    p.add_argument("--victim-voice", default="", help="a voice of the normal tenant")
    p.add_argument("--tokens-file", type=Path, default=None, help="JSON list of normal streams' tokens")
    args = p.parse_args(argv)
    target = Target(
        ws_port=args.ws_port,
        http_port=args.http_port,
        wyoming_port=args.wyoming_port,
        key=args.key,
        source=args.source,
        origin=args.origin,
        victim_voice=args.victim_voice,
        tokens_file=args.tokens_file,
    )
    print(json.dumps(asyncio.run(run(args.kind, target, args.seconds))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
