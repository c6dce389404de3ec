"""How the soak sends each bad input of :data:`bench.soak.plan.BAD_INPUTS` on a connection.

The plan names the bad input and the code the server must answer; this module only puts it on
the wire. :meth:`bench.soak.load.Soak._bad` then waits for the error and checks that the
connection is still usable.
"""

from __future__ import annotations

import secrets

from bench.soak.connection import Conn, StreamState
from bench.soak.plan import Plan


async def send_bad_input(conn: Conn, plan: Plan, max_chars: int) -> list[StreamState]:
    """Send ``plan.sub``'s bad input as stream ``bad``; the good streams it started first.

    Some bad inputs need good streams before them (a duplicate id, one stream too many, an
    ``append`` to a stream that is not incremental): those must still complete.
    """
    short = plan.text.text
    others: list[StreamState] = []
    conn.track(StreamState("bad"))
    sub = plan.sub
    if sub == "malformed_json":
        await conn.send('{"type": "start", "id": ')
    elif sub == "unknown_type":
        await conn.send({"type": "frobnicate", "id": "bad"})
    elif sub == "too_long":
        text = (short * (max_chars // max(1, len(short)) + 2))[: max_chars + 1 + plan.index % 100]
        await conn.send({"type": "start", "id": "bad", "text": text})
    elif sub == "bad_format":
        await conn.send({"type": "start", "id": "bad", "text": short, "format": "aac"})
    elif sub == "bad_rate":
        await conn.send({"type": "start", "id": "bad", "text": short, "sample_rate": 22_050})
    elif sub == "bad_voice":
        await conn.send({"type": "start", "id": "bad", "text": short, "voice": "nobody-here"})
    elif sub == "bad_field":
        await conn.send({"type": "start", "id": "bad", "text": short, "speed": 7.5})
    elif sub == "binary":
        await conn.send(b"\x01\x00\x00\x00")
    elif sub == "cancel_unknown":
        await conn.send({"type": "cancel", "id": "bad"})
    elif sub == "resume_unknown":
        await conn.send({"type": "resume", "stream": secrets.token_urlsafe(24), "after_seq": 3})
    elif sub == "unspeakable":
        await conn.send({"type": "start", "id": "bad", "text": "。。。！！ ... "})
    elif sub == "duplicate_id":
        first = StreamState("bad")
        await conn.start(first, short, plan.fmt, plan.seed)
        others.append(first)
        await conn.send({"type": "start", "id": "bad", "text": short})
    elif sub == "too_many_streams":
        for k, text_k in enumerate(plan.extra_texts):
            state = StreamState(f"t{k}")
            await conn.start(state, text_k.text, plan.fmt, None if plan.seed is None else plan.seed + k)
            others.append(state)
        await conn.send({"type": "start", "id": "bad", "text": short})
    elif sub == "append_not_incremental":
        first = StreamState("bad")
        await conn.start(first, short, plan.fmt, plan.seed)
        others.append(first)
        await conn.send({"type": "append", "id": "bad", "text": "more."})
    return others
