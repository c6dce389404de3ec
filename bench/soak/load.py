"""The load: the plan's requests played against one server by concurrent workers, one scenario per kind.

Each request kind of :data:`bench.soak.plan.KIND_WEIGHTS` is a ``_<kind>`` method of :class:`Soak`;
a request never raises (a failure becomes its :class:`Outcome`'s problem), and abandoned streams
are verified freed after the TTL in tasks the load owns, so the drain waits for them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from websockets.exceptions import ConnectionClosed

from bench.harness.textset import BenchText
from bench.soak.bad_inputs import send_bad_input
from bench.soak.connection import Conn, StreamState, refused
from bench.soak.outcome import Outcome
from bench.soak.plan import BAD_INPUTS, Plan


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
        try:
            others = await send_bad_input(conn, plan, int(self.hello.get("max_text_chars", 2000)))
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
