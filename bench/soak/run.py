"""Soak benchmark (issue #9): thousands of mixed requests against one server; RSS and fds stay flat.

``python -m bench.soak --requests 2000 --concurrency 12 --engine chattts --model-dir DIR``
starts a ``serve`` subprocess (short ``--resume-ttl-s``), then runs a seeded random
mix of requests with ``--concurrency`` workers, each request on its own connection(s):

- ``complete``: one stream, short/medium/long/extra-long text (up to the server's
  ``max_text_chars``), Chinese or English, ``pcm16`` or ``opus``; must end ``complete``;
- ``repeat``: the same, drawn from a small pool of (text, format, seed): cache hits;
- ``cancel``: ``cancel`` after a few frames; must end ``cancelled`` (or ``complete``
  when it finished first);
- ``abandon``: the socket is aborted after a few frames and never resumed; the stream
  must be freed after the TTL (a later ``resume`` of its token answers ``unknown_stream``);
- ``resume``: the socket is aborted once or twice, each time followed by ``resume`` on
  a new connection; the stream must complete with every seq received exactly once;
- ``incremental``: ``append`` pieces (with a ``flush``), then ``end``; must complete;
- ``multi``: 2 to ``max_streams`` streams at once on one connection;
- ``bad``: a bad input (malformed JSON, unknown type, too-long text, unsupported format,
  rate or voice, out-of-range field, binary frame, duplicate id, too many streams, ...)
  must get its error code, and a stream on the same connection afterwards must complete.

Every stream that got ``started`` is accounted for: it reached ``done`` (with the
expected reason, seqs 0..last_seq each exactly once, one last-frame flag), or it was
abandoned on purpose and verified freed; anything else is *lost*. The server's RSS, open
fds and ``/metrics`` gauges are sampled every second (:mod:`bench.soak.report`). After the
load, ``chattts_active_streams`` must return to 0 and SIGTERM must exit 0.

Writes ``OUT`` (JSON), ``OUT`` with ``.png`` (plot) and ``.md`` (report); exit status 1
when an acceptance check fails, 2 when the server could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import math
import random
import secrets
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench.harness.client import fetch_hello
from bench.harness.machine import describe_machine
from bench.harness.sampler import Sampler, read_gauges, samples_as_dicts
from bench.harness.servers import CHILD_ENV, ServerProcess
from bench.harness.textset import DEFAULT_TEXTS, BenchText, load_texts
from bench.soak import churn as soak_churn
from bench.soak.churn import DEFAULT_MARGIN_MIB
from bench.soak.report import RSS_GROWTH_LIMIT_PCT, analyse_samples, markdown, plot

SCHEMA = "chattts-stream-soak/1"
FLAG_LAST = 0x01

#: Request kinds and their default weights in the mix.
KIND_WEIGHTS: dict[str, float] = {
    "complete": 0.28,
    "repeat": 0.08,
    "cancel": 0.12,
    "abandon": 0.10,
    "resume": 0.12,
    "incremental": 0.08,
    "multi": 0.06,
    "bad": 0.16,
}
#: Text sizes and their weights; ``xlong`` is built up to the server's ``max_text_chars``.
SIZE_WEIGHTS: dict[str, float] = {"short": 0.55, "medium": 0.3, "long": 0.12, "xlong": 0.03}
#: Bad inputs: sub-kind → the error code the server must answer.
BAD_INPUTS: dict[str, str] = {
    "malformed_json": "bad_request",
    "unknown_type": "bad_request",
    "too_long": "text_too_long",
    "bad_format": "unsupported",
    "bad_rate": "unsupported",
    "bad_voice": "unsupported",
    "bad_field": "bad_request",
    "binary": "bad_request",
    "cancel_unknown": "bad_request",
    "resume_unknown": "unknown_stream",
    "unspeakable": "bad_request",
    "duplicate_id": "duplicate_id",
    "too_many_streams": "too_many_streams",
    "append_not_incremental": "bad_request",
}
REPEAT_POOL = 12


# --- the plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One request of the soak, fixed before the run (seeded)."""

    index: int
    kind: str
    sub: str
    text: BenchText
    fmt: str
    seed: int | None
    cut_after: tuple[int, ...]  # frames before each cancel/cut
    pause_frac: float  # before a resume, as a fraction of the resume TTL (at most a quarter)
    pieces: tuple[str, ...]  # incremental
    extra_texts: tuple[BenchText, ...]  # multi / too_many_streams


def build_long_text(rng: random.Random, pool: list[BenchText], lang: str, lo: int, hi: int) -> BenchText:
    """Concatenate texts of ``lang`` until the length lies in ``[lo, hi]`` characters."""
    target = rng.randint(lo, hi)
    same = [t for t in pool if t.lang == lang] or pool
    sep = " " if lang == "en" else ""
    out = ""
    while True:
        piece = rng.choice(same).text
        if len(out) + len(sep) + len(piece) > target:
            break
        out = f"{out}{sep}{piece}" if out else piece
    if len(out) < lo:  # top up with the start of one more text, cut at a word boundary
        out = (out + sep + rng.choice(same).text * 4)[:target].rstrip()
    return BenchText(out, lang, "xlong")


def make_plan(n: int, seed: int, texts: list[BenchText], max_text_chars: int, max_streams: int) -> list[Plan]:
    """The seeded request mix (same ``seed`` and server limits → the same plan)."""
    rng = random.Random(seed)
    kinds, kind_w = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    sizes, size_w = list(SIZE_WEIGHTS), list(SIZE_WEIGHTS.values())
    by_size = {s: [t for t in texts if t.size == s] for s in ("short", "medium", "long")}

    def pick_text(size: str) -> BenchText:
        if size == "xlong":
            lang = rng.choice(["zh", "en"])
            return build_long_text(rng, texts, lang, max_text_chars * 6 // 10, max_text_chars)
        return rng.choice(by_size.get(size) or texts)

    repeat_pool = [
        (rng.choice(by_size.get("short") or texts), rng.choice(["pcm16", "opus"]), rng.randrange(1, 10**6))
        for _ in range(REPEAT_POOL)
    ]
    plans: list[Plan] = []
    for index in range(n):
        kind = rng.choices(kinds, kind_w)[0]
        size = rng.choices(sizes, size_w)[0]
        if kind in ("incremental", "multi") and size == "xlong":
            size = "long"
        text = pick_text(size)
        fmt = "opus" if rng.random() < 0.4 else "pcm16"
        seed_value: int | None = rng.randrange(10**6, 2**31) if rng.random() < 0.85 else None
        sub = ""
        extra: tuple[BenchText, ...] = ()
        if kind == "repeat":
            text, fmt, seed_value = repeat_pool[rng.randrange(REPEAT_POOL)]
        elif kind == "bad":
            sub = rng.choice(list(BAD_INPUTS))
            text = rng.choice(by_size.get("short") or texts)
            if sub == "too_many_streams":
                extra = tuple(rng.choice(by_size.get("short") or texts) for _ in range(max_streams))
        elif kind == "multi":
            extra = tuple(
                rng.choice(by_size.get(rng.choice(["short", "medium"])) or texts)
                for _ in range(rng.randint(2, max(2, max_streams)))
            )
        pieces: tuple[str, ...] = ()
        if kind == "incremental":
            cuts = sorted(rng.sample(range(1, len(text.text)), min(rng.randint(1, 5), len(text.text) - 1)))
            bounds = [0, *cuts, len(text.text)]
            pieces = tuple(text.text[a:b] for a, b in itertools.pairwise(bounds))
        plans.append(
            Plan(
                index=index,
                kind=kind,
                sub=sub,
                text=text,
                fmt=fmt,
                seed=seed_value,
                cut_after=tuple(rng.randint(1, 40) for _ in range(rng.choice([1, 1, 2]))),
                pause_frac=rng.uniform(0.0, 0.25),
                pieces=pieces,
                extra_texts=extra,
            )
        )
    return plans


# --- one request's outcome ------------------------------------------------------------


@dataclass
class Outcome:
    """What happened to one request (every stream it started is accounted for)."""

    index: int
    kind: str
    sub: str
    fmt: str
    size: str
    chars: int
    outcome: str = ""
    problem: str | None = None
    started: int = 0  # `started` messages (streams the server created)
    done: int = 0  # `done` messages
    abandoned_freed: int = 0  # abandoned on purpose and verified freed after the TTL
    expected_errors: list[str] = field(default_factory=list)
    received_errors: list[str] = field(default_factory=list)
    frames: int = 0
    resumes: int = 0
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def lost(self) -> int:
        """Streams started but neither done nor verified freed."""
        return max(0, self.started - self.done - self.abandoned_freed)

    def fail(self, problem: str) -> None:
        """Record the first problem of this request."""
        if self.problem is None:
            self.problem = problem

    def settle(self, problem: str | None, outcome: str) -> None:
        """Record ``problem`` if there is one, else the request's ``outcome``."""
        if problem:
            self.fail(problem)
        else:
            self.outcome = outcome

    def compact(self) -> dict[str, Any]:
        """The per-request record in the JSON file."""
        record = asdict(self)
        record["t_start"], record["t_end"] = round(self.t_start, 3), round(self.t_end, 3)
        record["lost"] = self.lost
        return record


# --- a protocol client connection that tracks every stream ----------------------------


@dataclass
class StreamState:
    """One stream as the client saw it, across connections."""

    sid: str
    token: str | None = None
    seqs: Counter[int] = field(default_factory=Counter)
    last_flag_seqs: list[int] = field(default_factory=list)
    done: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    attached: bool = False
    frames_here: int = 0  # frames on the current connection

    def contiguous_last(self) -> int:
        """The last seq received with no gap before it (``-1`` for none)."""
        seq = -1
        while seq + 1 in self.seqs:
            seq += 1
        return seq

    def check(self, reasons: tuple[str, ...]) -> str | None:
        """``None`` when the stream ended as expected with every seq exactly once."""
        done = self.done
        if done is None:
            return "no done"
        if done.get("reason") not in reasons:
            return f"done reason {done.get('reason')!r}, expected {'/'.join(reasons)}"
        last = done.get("last_seq")
        dupes = sorted(s for s, c in self.seqs.items() if c != 1)
        if dupes:
            return f"seqs received more than once: {dupes[:5]}"
        if not isinstance(last, int) or set(self.seqs) != set(range(last + 1)):
            missing = sorted(set(range(last + 1)) - set(self.seqs)) if isinstance(last, int) else []
            return f"seqs are not 0..{last}: {len(self.seqs)} received, missing {missing[:5]}"
        if self.last_flag_seqs != [last]:
            return f"last-frame flag on seqs {self.last_flag_seqs[:5]}, expected [{last}]"
        return None


class Conn:
    """One client connection; routes frames and messages to :class:`StreamState` by slot and id."""

    def __init__(self, ws: ClientConnection, outcome: Outcome) -> None:
        self.ws = ws
        self.outcome = outcome
        self.streams: dict[str, StreamState] = {}
        self.slots: dict[int, StreamState] = {}
        self.loose_errors: list[dict[str, Any]] = []
        self.errors_seen = 0

    @classmethod
    async def open(cls, url: str, outcome: Outcome, query: str = "") -> Conn:
        """Connect and read ``hello``."""
        ws = await connect(url + query, compression=None, max_size=None, ping_interval=None, open_timeout=60)
        conn = cls(ws, outcome)
        hello = json.loads(await ws.recv())
        if hello.get("type") != "hello":
            await conn.close()
            raise ValueError(f"expected hello, got {hello!r}")
        return conn

    def track(self, state: StreamState) -> StreamState:
        """Route messages for ``state.sid`` on this connection to ``state``."""
        state.attached = False
        state.frames_here = 0
        self.streams[state.sid] = state
        return state

    async def send(self, message: dict[str, Any] | str | bytes) -> None:
        """Send a JSON object, or a raw text/binary frame."""
        data = json.dumps(message, ensure_ascii=False) if isinstance(message, dict) else message
        await self.ws.send(data)

    async def start(
        self, state: StreamState, text: str | None, fmt: str, seed: int | None, **extra: Any
    ) -> None:
        """Send ``start`` for a tracked stream."""
        self.track(state)
        message: dict[str, Any] = {"type": "start", "id": state.sid, "format": fmt, **extra}
        if text is not None:
            message["text"] = text
        if seed is not None:
            message["seed"] = seed
        await self.send(message)

    async def resume(self, state: StreamState) -> list[str]:
        """Re-attach ``state`` here after its last contiguous seq; the error codes when refused."""
        assert state.token is not None
        self.track(state)
        before = len(self.loose_errors)
        await self.send({"type": "resume", "stream": state.token, "after_seq": state.contiguous_last()})
        await self.until(lambda: state.attached or bool(state.errors) or len(self.loose_errors) > before)
        if state.attached:
            return []
        return state.errors + [str(e.get("code")) for e in self.loose_errors[before:]]

    async def recv_one(self) -> None:
        """Receive one message and apply it to its stream."""
        raw = await self.ws.recv()
        if isinstance(raw, bytes):
            flags, slot = raw[1], int.from_bytes(raw[2:4], "little")
            seq = int.from_bytes(raw[4:8], "little")
            state = self.slots.get(slot)
            if state is None:
                raise ProtocolViolation(f"frame for unknown slot {slot}")
            state.seqs[seq] += 1
            state.frames_here += 1
            self.outcome.frames += 1
            if flags & FLAG_LAST:
                state.last_flag_seqs.append(seq)
            return
        message = json.loads(raw)
        kind = message.get("type")
        state = self.streams.get(message.get("id", ""))
        if kind == "error":
            self.errors_seen += 1
            self.outcome.received_errors.append(str(message.get("code")))
            if state is not None:
                state.errors.append(str(message.get("code")))
            else:
                self.loose_errors.append(message)
            return
        if state is None:
            raise ProtocolViolation(f"message for an unknown stream: {str(message)[:200]}")
        if kind in ("started", "resumed"):
            if kind == "started":
                self.outcome.started += 1
            state.token = message["stream"]
            state.attached = True
            self.slots[int(message["slot"])] = state
        elif kind == "done":
            state.done = message
            self.outcome.done += 1
            self.slots.pop(int(message["slot"]), None)

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Receive until ``predicate()`` holds (checked before each receive)."""
        while not predicate():
            await self.recv_one()

    async def barrier(self) -> None:
        """Wait until the server processed everything sent so far (a ``cancel`` of a bogus id)."""
        probe = f"probe-{secrets.token_hex(4)}"
        before = len(self.loose_errors)
        await self.send({"type": "cancel", "id": probe})

        def answered() -> bool:
            return any(e.get("id") == probe for e in self.loose_errors[before:])

        await self.until(answered)
        for error in self.loose_errors[before:]:
            if error.get("id") == probe:
                self.outcome.received_errors.remove("bad_request")
        self.loose_errors = [e for e in self.loose_errors if e.get("id") != probe]

    def abort(self) -> None:
        """Drop the TCP connection without a close handshake (the network went away)."""
        self.ws.transport.abort()

    async def close(self) -> None:
        """Close (quietly; the connection may already be gone)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await self.ws.close()


class ProtocolViolation(Exception):
    """The server sent something the protocol does not allow here."""


def refused(state: StreamState) -> bool:
    """The stream got an error before it was attached (its ``start`` was refused)."""
    return bool(state.errors) and not state.attached and state.done is None


# --- the scenarios --------------------------------------------------------------------


class Soak:
    """Runs the plan against one server and collects outcomes."""

    def __init__(self, url: str, hello: dict[str, Any], args: argparse.Namespace) -> None:
        self.url = url
        self.hello = hello
        self.args = args
        self.ttl_s = float(hello.get("resume_ttl_s", args.resume_ttl_s))
        self.outcomes: list[Outcome] = []
        self.finished = 0
        self.finish_times: list[float] = []
        self.clock: Callable[[], float] = time.perf_counter
        self._checks: asyncio.TaskGroup | None = None

    async def run(self, plans: list[Plan], concurrency: int, on_load_end: Callable[[], None]) -> None:
        """Run every plan with ``concurrency`` workers; abandoned streams are verified in owned tasks."""
        queue = iter(plans)
        async with asyncio.TaskGroup() as checks:
            self._checks = checks
            async with asyncio.TaskGroup() as workers:
                for n in range(concurrency):
                    workers.create_task(self._worker(queue), name=f"soak-worker-{n}")
            on_load_end()
        self._checks = None

    async def _worker(self, queue: Any) -> None:
        for plan in queue:
            outcome = await self.run_one(plan)
            self.outcomes.append(outcome)
            self.finished += 1
            self.finish_times.append(self.clock())
            total = self.args.requests
            if self.finished % max(1, total // 10) == 0 or self.finished == total:
                problems = sum(1 for o in self.outcomes if o.problem)
                print(
                    f"bench.soak: {self.finished}/{total} requests at {self.clock():.0f} s, "
                    f"{problems} with a problem",
                    file=sys.stderr,
                    flush=True,
                )

    async def run_one(self, plan: Plan) -> Outcome:
        """One request, never raising: failures become ``outcome.problem``."""
        out = Outcome(plan.index, plan.kind, plan.sub, plan.fmt, plan.text.size, len(plan.text.text))
        out.t_start = self.clock()
        scenario = getattr(self, f"_{plan.kind}")
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                await scenario(plan, out)
        except TimeoutError:
            out.fail(f"timeout after {self.args.request_timeout_s} s")
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else 1006
            out.fail(f"connection closed unexpectedly ({code})")
        except Exception as exc:  # a bug on either side: record it, keep soaking
            out.fail(f"{type(exc).__name__}: {exc}")
        out.t_end = self.clock()
        expected, received = Counter(out.expected_errors), Counter(out.received_errors)
        if expected != received and out.problem is None:
            out.fail(f"error codes {dict(received)} != expected {dict(expected)}")
        if not out.outcome:
            out.outcome = "problem"
        return out

    async def _run_to_done(
        self, conn: Conn, plan: Plan, out: Outcome, sid: str, text: BenchText | None = None
    ) -> StreamState:
        """Start one stream and read until its ``done`` (or a refusal)."""
        state = StreamState(sid)
        await conn.start(state, (text or plan.text).text, plan.fmt, plan.seed)
        await conn.until(lambda: state.done is not None or bool(state.errors))
        return state

    async def _complete(self, plan: Plan, out: Outcome) -> None:
        conn = await Conn.open(self.url, out)
        try:
            state = await self._run_to_done(conn, plan, out, "s")
            out.settle(state.check(("complete",)), "complete")
        finally:
            await conn.close()

    async def _repeat(self, plan: Plan, out: Outcome) -> None:
        await self._complete(plan, out)

    async def _start_until_cut(self, conn: Conn, sid: str, plan: Plan, out: Outcome) -> StreamState | None:
        """Start a stream and receive until its first cut point or its end; None if refused."""
        state = StreamState(sid)
        await conn.start(state, plan.text.text, plan.fmt, plan.seed)
        await conn.until(
            lambda: refused(state) or state.done is not None or state.frames_here >= plan.cut_after[0]
        )
        if refused(state):
            out.fail(f"start refused: {state.errors}")
            return None
        return state

    async def _cancel(self, plan: Plan, out: Outcome) -> None:
        conn = await Conn.open(self.url, out)
        try:
            state = await self._start_until_cut(conn, "c", plan, out)
            if state is None:
                return
            if state.done is not None:
                out.outcome = "complete_before_cancel"
                problem = state.check(("complete",))
            else:
                await conn.send({"type": "cancel", "id": "c"})
                await conn.until(lambda: state.done is not None)
                if state.done.get("reason") == "complete":
                    # The stream finished while the cancel was on its way: the server may
                    # answer the late cancel with bad_request (no live stream "c").
                    await conn.barrier()
                    out.expected_errors += [c for c in state.errors if c == "bad_request"]
                    out.outcome = "complete_before_cancel"
                    problem = state.check(("complete",))
                else:
                    out.outcome = "cancelled"
                    problem = state.check(("cancelled",))
            if problem:
                out.fail(problem)
        finally:
            await conn.close()

    async def _abandon(self, plan: Plan, out: Outcome) -> None:
        conn = await Conn.open(self.url, out)
        try:
            state = await self._start_until_cut(conn, "a", plan, out)
            if state is None:
                return
            if state.done is not None:
                out.outcome = "complete_before_cut"
                if problem := state.check(("complete",)):
                    out.fail(problem)
                return
            conn.abort()
        finally:
            await conn.close()
        assert state.token is not None
        due = self.clock() + self.ttl_s + self.args.free_margin_s
        if self._checks is None:
            await self._verify_freed(out, state, due)
        else:
            out.outcome = "abandoned_pending"
            self._checks.create_task(self._verify_freed(out, state, due), name=f"verify-{plan.index}")

    async def _verify_freed(self, out: Outcome, state: StreamState, due: float) -> None:
        """After the TTL, the abandoned stream's token must answer ``unknown_stream``."""
        try:
            await asyncio.sleep(max(0.0, due - self.clock()))
            async with asyncio.timeout(self.args.request_timeout_s):
                conn = await Conn.open(self.url, out)
                try:
                    probe = conn.track(StreamState(state.sid, token=state.token))
                    await conn.send(
                        {"type": "resume", "stream": state.token, "after_seq": state.contiguous_last()}
                    )
                    await conn.until(lambda: bool(conn.loose_errors) or probe.attached or bool(probe.errors))
                    codes = [str(e.get("code")) for e in conn.loose_errors] + probe.errors
                    if codes == ["unknown_stream"]:
                        out.expected_errors.append("unknown_stream")
                        out.abandoned_freed += 1
                        out.outcome = "abandoned_freed"
                    else:
                        out.fail(
                            f"abandoned stream still held {self.ttl_s + self.args.free_margin_s:.1f} s"
                            f" after the disconnect (resume answered {codes or 'resumed'})"
                        )
                        out.outcome = "abandoned_not_freed"
                        if probe.attached:  # it is ours now: end it so it does not linger
                            await conn.send({"type": "cancel", "id": state.sid})
                            await conn.until(lambda: probe.done is not None)
                finally:
                    await conn.close()
        except Exception as exc:
            out.fail(f"verifying the abandoned stream: {type(exc).__name__}: {exc}")
            out.outcome = "abandoned_unverified"
        finally:
            expected, received = Counter(out.expected_errors), Counter(out.received_errors)
            if expected != received:
                out.fail(f"error codes {dict(received)} != expected {dict(expected)}")

    async def _resume(self, plan: Plan, out: Outcome) -> None:
        conn = await Conn.open(self.url, out)
        state = StreamState("r")
        try:
            await conn.start(state, plan.text.text, plan.fmt, plan.seed)
            for n, cut in enumerate([*plan.cut_after, None]):
                if cut is None:
                    await conn.until(lambda: state.done is not None)
                    break
                await conn.until(
                    lambda c=cut: refused(state) or state.done is not None or state.frames_here >= c
                )
                if refused(state):
                    out.fail(f"start refused: {state.errors}")
                    return
                if state.done is not None:
                    break
                conn.abort()
                await conn.close()
                # A fraction of the TTL, so the reconnect itself has most of the TTL even on a loaded machine.
                await asyncio.sleep(plan.pause_frac * self.ttl_s)
                assert state.token is not None
                conn = await Conn.open(self.url, out, query=f"?resume={state.token}")
                codes = await conn.resume(state)
                if codes:
                    out.fail(f"resume {n + 1} refused: {codes}")
                    return
                out.resumes += 1
            problem = state.check(("complete",))
            out.settle(problem, "resumed_complete" if out.resumes else "complete_before_cut")
        finally:
            await conn.close()

    async def _incremental(self, plan: Plan, out: Outcome) -> None:
        conn = await Conn.open(self.url, out)
        rng = random.Random(plan.index)
        try:
            state = StreamState("i")
            await conn.start(state, plan.pieces[0], plan.fmt, plan.seed, incremental=True)

            async def write() -> None:
                for k, piece in enumerate(plan.pieces[1:], start=1):
                    await asyncio.sleep(rng.uniform(0.0, 0.15))
                    await conn.send({"type": "append", "id": "i", "text": piece})
                    if k == len(plan.pieces) // 2:
                        await conn.send({"type": "flush", "id": "i"})
                await conn.send({"type": "end", "id": "i"})

            async with asyncio.TaskGroup() as group:
                group.create_task(write(), name="incremental-writer")
                group.create_task(conn.until(lambda: state.done is not None or bool(state.errors)))
            out.settle(state.check(("complete",)), "complete")
        finally:
            await conn.close()

    async def _multi(self, plan: Plan, out: Outcome) -> None:
        conn = await Conn.open(self.url, out)
        try:
            states = [StreamState(f"m{k}") for k in range(len(plan.extra_texts))]
            for k, (state, text) in enumerate(zip(states, plan.extra_texts, strict=True)):
                seed = None if plan.seed is None else plan.seed + k
                await conn.start(state, text.text, plan.fmt, seed)
            await conn.until(lambda: all(s.done is not None or s.errors for s in states))
            problems = [p for s in states if (p := s.check(("complete",)))]
            if problems:
                out.fail(problems[0])
            else:
                out.outcome = "complete"
        finally:
            await conn.close()

    async def _bad(self, plan: Plan, out: Outcome) -> None:
        """Send one bad input, expect its code, then a stream on the same connection must complete."""
        code = BAD_INPUTS[plan.sub]
        out.expected_errors.append(code)
        conn = await Conn.open(self.url, out)
        max_chars = int(self.hello.get("max_text_chars", 2000))
        short = plan.text.text
        others: list[StreamState] = []
        try:
            bad_id = StreamState("bad")
            conn.track(bad_id)
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
                    await conn.start(
                        state, text_k.text, plan.fmt, None if plan.seed is None else plan.seed + k
                    )
                    others.append(state)
                await conn.send({"type": "start", "id": "bad", "text": short})
            elif sub == "append_not_incremental":
                first = StreamState("bad")
                await conn.start(first, short, plan.fmt, plan.seed)
                others.append(first)
                await conn.send({"type": "append", "id": "bad", "text": "more."})
            await conn.until(lambda: conn.errors_seen >= 1)
            await conn.until(lambda: all(s.done is not None for s in others))
            problems = [p for s in others if (p := s.check(("complete",)))]
            # The connection stays usable: a normal stream must complete on it.
            after = await self._run_to_done(conn, plan, out, "after")
            problems += [p for p in [after.check(("complete",))] if p]
            if problems:
                out.fail(problems[0])
            else:
                out.outcome = f"{code}_then_complete"
        finally:
            await conn.close()


# --- the run --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="requests in all")
    p.add_argument("--concurrency", type=int, default=12, help="workers running requests at once")
    p.add_argument("--engine", choices=("chattts", "fake"), default="chattts")
    p.add_argument("--model-dir", default="", help="ChatTTS asset folder (e.g. a tiny dev model)")
    p.add_argument(
        "--dev-model", default="", choices=("", "tiny", "full"), help="serve a random-weight model"
    )
    p.add_argument("--resume-ttl-s", type=float, default=2.0, help="the server's --resume-ttl-s")
    p.add_argument(
        "--cache-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="the server's --cache-bytes: small, so the bounded response cache is full (and evicting) "
        "early in the warm-up instead of filling for most of the run",
    )
    p.add_argument("--server-flags", default="", help="further serve flags (shell-quoted)")
    p.add_argument("--seed", type=int, default=9, help="seeds the request mix")
    p.add_argument("--texts", type=Path, default=DEFAULT_TEXTS, help="text set (.jsonl with text/lang/size)")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up: this share of requests finished")
    p.add_argument(
        "--window-s", type=float, default=60.0, help="RSS median windows after warm-up / at the end"
    )
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument(
        "--idle-s", type=float, default=5.0, help="idle sampling before the load and after the drain"
    )
    p.add_argument(
        "--free-margin-s",
        type=float,
        default=3.0,
        help="slack after the TTL before checking a stream is freed",
    )
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY of the server ('' = inherit)"
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path (.png and .md beside it)")
    p.add_argument("--no-plot", action="store_true")
    churn = p.add_argument_group(
        "churn (bench.soak.churn): start/cancel from one client, default server flags"
    )
    churn.add_argument("--churn", action="store_true", help="run the churn soak instead of the mix")
    churn.add_argument("--duration-s", type=float, default=600.0, help="churn: how long, after the warm-up")
    churn.add_argument(
        "--warmup-s", type=float, default=30.0, help="churn: warm-up (the same churn) before it"
    )
    churn.add_argument("--churn-connections", type=int, default=4, help="churn: the client's connections")
    churn.add_argument(
        "--margin-mib",
        type=float,
        default=DEFAULT_MARGIN_MIB,
        help="churn: RSS allowed above the warm baseline plus the server's memory budget",
    )
    return p.parse_args(argv)


def server_flags(args: argparse.Namespace) -> list[str]:
    """``serve`` flags of the server under test."""
    flags = ["--engine", args.engine, "--resume-ttl-s", str(args.resume_ttl_s), "--http-port", "0"]
    flags += ["--cache-bytes", str(args.cache_bytes), "--log-level", "warning"]
    if args.model_dir:
        flags += ["--model-dir", args.model_dir]
    if args.dev_model:
        flags += ["--dev-model", args.dev_model]
    return flags + shlex.split(args.server_flags)


async def wait_active_zero(metrics_url: str, timeout_s: float) -> tuple[bool, float]:
    """Poll ``/metrics`` until ``chattts_active_streams`` is 0; (reached, seconds waited)."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout_s:
        gauges = await read_gauges(metrics_url)
        if gauges.get("chattts_active_streams") == 0:
            return True, time.perf_counter() - began
        await asyncio.sleep(0.25)
    return False, time.perf_counter() - began


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Accounting, kinds, error codes and problems of all requests."""
    started = sum(o.started for o in outcomes)
    done = sum(o.done for o in outcomes)
    freed = sum(o.abandoned_freed for o in outcomes)
    lost = sum(o.lost for o in outcomes)
    kinds: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        name = f"bad:{o.sub}" if o.kind == "bad" else o.kind
        entry = kinds.setdefault(name, {"n": 0, "outcomes": Counter()})
        entry["n"] += 1
        entry["outcomes"][o.outcome] += 1
    expected: Counter[str] = Counter()
    received: Counter[str] = Counter()
    for o in outcomes:
        expected.update(o.expected_errors)
        received.update(o.received_errors)
    problems = [
        {"index": o.index, "kind": f"bad:{o.sub}" if o.kind == "bad" else o.kind, "problem": o.problem}
        for o in sorted(outcomes, key=lambda o: o.index)
        if o.problem
    ]
    return {
        "accounting": {
            "requests": len(outcomes),
            "requests_ok": len(outcomes) - len(problems),
            "started": started,
            "done": done,
            "abandoned_freed": freed,
            "lost": lost,
            "balanced": started == done + freed + lost,
        },
        "kinds": {k: {"n": v["n"], "outcomes": dict(v["outcomes"])} for k, v in kinds.items()},
        "errors": {"expected": dict(expected), "received": dict(received)},
        "problems": problems,
    }


async def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Start the server, soak it, judge the samples; returns the results."""
    if args.omp_wait_policy:
        CHILD_ENV.setdefault("OMP_WAIT_POLICY", args.omp_wait_policy)
    log_path = Path(tempfile.gettempdir()) / f"soak-server-{time.strftime('%Y%m%d-%H%M%S')}.log"
    server = ServerProcess(server_flags(args), log_path=log_path)
    await server.start()
    assert server.proc is not None
    metrics_url = f"http://127.0.0.1:{server.port}/metrics"
    exit_code: int | None = None
    try:
        hello = await fetch_hello(server.url)
        texts = load_texts(args.texts)
        plans = make_plan(
            args.requests, args.seed, texts, int(hello["max_text_chars"]), int(hello["max_streams"])
        )
        soak = Soak(server.url, hello, args)
        sampler = Sampler(server.proc.pid, metrics_url, args.sample_interval_s, lambda: soak.finished)
        sampler.t0 = time.perf_counter() + args.idle_s
        soak.clock = sampler.now
        sampler.start()
        try:
            await asyncio.sleep(args.idle_s)
            sampler.phase = "load"
            load_end = 0.0

            def on_load_end() -> None:
                nonlocal load_end
                load_end = sampler.now()
                sampler.phase = "drain"

            await soak.run(plans, args.concurrency, on_load_end)
            zero, zero_after = await wait_active_zero(metrics_url, soak.ttl_s + 60.0)
            gauges = await read_gauges(metrics_url)
            sampler.phase = "idle_after"
            await asyncio.sleep(args.idle_s)
        finally:
            await sampler.stop()
    finally:
        exit_code = await server.stop()
    finish = sorted(soak.finish_times)
    warm_n = max(1, math.ceil(args.requests * args.warmup_frac))
    warmup_end = finish[min(warm_n, len(finish)) - 1] if finish else 0.0
    memory = analyse_samples(sampler.samples, warmup_end, load_end, args.window_s)
    summary = summarize(soak.outcomes)
    rss = memory.get("rss") or {}
    fds = memory.get("fds") or {}
    growth = rss.get("growth_robust_pct")
    checks = {
        "rss_growth_under_5pct": growth is not None and growth < RSS_GROWTH_LIMIT_PCT,
        "no_fd_growth": fds.get("growth_idle") is not None and fds["growth_idle"] <= 0,
        "zero_lost_streams": summary["accounting"]["lost"] == 0 and summary["accounting"]["balanced"],
        "every_request_as_expected": not summary["problems"],
        "active_streams_back_to_0": zero,
        "clean_exit_on_sigterm": exit_code == 0,
    }
    load_wall = load_end
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.soak", *argv]),
        "machine": describe_machine(),
        "config": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "engine": args.engine,
            "model": args.model_dir or args.dev_model,
            "seed": args.seed,
            "warmup_frac": args.warmup_frac,
            "window_s": args.window_s,
            "sample_interval_s": args.sample_interval_s,
            "resume_ttl_s": args.resume_ttl_s,
            "cache_bytes": args.cache_bytes,
            "free_margin_s": args.free_margin_s,
            "kind_weights": KIND_WEIGHTS,
            "size_weights": SIZE_WEIGHTS,
            "bad_inputs": BAD_INPUTS,
            "child_env": dict(CHILD_ENV),
        },
        "server": {**server.describe(), "hello": hello, "log": str(log_path)},
        "load_wall_s": load_wall,
        "requests_per_s": args.requests / load_wall if load_wall > 0 else None,
        "memory": memory,
        **summary,
        "cache": {
            "hits": gauges.get("chattts_cache_hits_total"),
            "misses": gauges.get("chattts_cache_misses_total"),
        },
        "end": {"active_streams_zero": zero, "active_zero_after_s": zero_after, "exit_code": exit_code},
        "acceptance": {"pass": all(checks.values()), "checks": checks},
        "requests": [o.compact() for o in sorted(soak.outcomes, key=lambda o: o.index)],
        "samples": samples_as_dicts(sampler.samples),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak``: run, write JSON/PNG/MD, exit 1 when an acceptance check fails."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.engine == "chattts" and not (args.model_dir or args.dev_model):
        print("bench.soak: --engine chattts needs --model-dir or --dev-model", file=sys.stderr)
        return 2
    if args.churn:
        return soak_churn.main(args, argv)
    out: Path = args.out or Path(tempfile.gettempdir()) / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        import uvloop

        results = uvloop.run(run(args, argv))
    except RuntimeError as exc:
        print(f"bench.soak: {exc}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    png = out.with_suffix(".png")
    if not args.no_plot:
        plot(results, png)
    md = markdown(results, None if args.no_plot else png.name)
    out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    print(f"bench.soak: wrote {out}", file=sys.stderr)
    return 0 if results["acceptance"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
