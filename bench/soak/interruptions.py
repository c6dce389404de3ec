"""pipecat's and LiveKit's own ElevenLabs services, interrupted again and again (issue #42, acceptance 3).

``python -m bench.soak.interruptions --rounds 100 --out bench/results/soak/interruptions-<hw>`` starts
one ``serve`` subprocess (fake engine, slower than a GPU so that every answer is still being made
when it is interrupted), then drives the frameworks' unchanged services with only their base URL
pointed at it:

- pipecat's ``ElevenLabsTTSService``: an LLM answer, then an ``InterruptionFrame`` while its audio
  flows (pipecat closes the context and reconnects its WebSocket mid-turn), ``--rounds`` times;
- LiveKit's ``livekit-plugins-elevenlabs`` ``TTS``: a stream's text while the LLM is still
  answering (no ``flush``), then ``aclose()`` once its first audio came (an agent's interruption),
  ``--rounds`` times. (Once LiveKit has flushed the whole answer it closes the context as at the
  end of a turn, and its later ``aclose()`` sends nothing: the server then speaks the answer to
  its end, as ElevenLabs' protocol asks; that stream ends with its audio, not at the interruption.)

``chattts_active_streams`` is sampled every ``--sample-ms`` from ``/metrics``; for each
interruption the report gives the time until it was back to 0. Then the server gets SIGTERM,
and its exit is timed against ``--drain-timeout-s``. Pass: every interruption freed its
stream within ``--release-s`` (1 s), and the server exited 0 within the drain timeout.
Writes ``OUT.json`` and ``OUT.md``; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.machine import describe_machine
from bench.harness.servers import ServerProcess

ANSWER = " ".join(
    f"This is sentence number {n} of a long answer, and it goes on for a while." for n in range(1, 9)
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(
        prog="python -m bench.soak.interruptions", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rounds", type=int, default=100, help="interruptions per framework")
    p.add_argument("--clients", default="pipecat,livekit", help="frameworks to drive (comma-separated)")
    p.add_argument("--speak-s", type=float, default=0.8, help="how long an answer plays before it is cut")
    p.add_argument("--gap-s", type=float, default=1.2, help="pause after each interruption")
    p.add_argument(
        "--release-s", type=float, default=1.0, help="an interruption must free its stream in this"
    )
    p.add_argument("--sample-ms", type=float, default=20.0, help="how often active streams are read")
    p.add_argument("--drain-timeout-s", type=float, default=10.0, help="the server's --drain-timeout-s")
    p.add_argument(
        "--fake-step-ms", type=float, default=100.0, help="the fake engine's step (slower: longer)"
    )
    p.add_argument("--out", type=Path, default=None, help="output stem: OUT.json and OUT.md")
    return p.parse_args(argv)


def read_active(metrics_url: str) -> float | None:
    """``chattts_active_streams`` now (None when ``/metrics`` does not answer)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2.0) as response:
            text = response.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("chattts_active_streams "):
            return float(line.split()[1])
    return None


class ActiveSampler:
    """Samples ``chattts_active_streams`` every ``interval_s`` on a thread-backed task it owns."""

    def __init__(self, metrics_url: str, interval_s: float) -> None:
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []  # (monotonic time, active streams)
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            value = await asyncio.to_thread(read_active, self.metrics_url)
            if value is not None:
                self.samples.append((time.monotonic(), value))
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Begin sampling."""
        self._task = asyncio.create_task(self._run(), name="active-sampler")

    async def stop(self) -> None:
        """Stop sampling (and wait for the task)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def release_delays(samples: list[tuple[float, float]], cuts: list[float]) -> list[float | None]:
    """For each interruption in ``cuts``: seconds until no stream was active (None: not before the next)."""
    delays: list[float | None] = []
    for i, cut in enumerate(cuts):
        until = cuts[i + 1] if i + 1 < len(cuts) else float("inf")
        zero = next((t for t, value in samples if cut <= t < until and value == 0), None)
        delays.append(None if zero is None else zero - cut)
    return delays


async def drive_pipecat(http_port: int, args: argparse.Namespace) -> list[float]:
    """pipecat's ElevenLabsTTSService, interrupted ``args.rounds`` times; returns the interruption times."""
    from pipecat.frames.frames import (
        InterruptionFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
    )
    from pipecat.observers.base_observer import BaseObserver, FramePushed
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
    from pipecat.tests.utils import SleepFrame, run_test

    cuts: list[float] = []

    class Cuts(BaseObserver):  # type: ignore[misc]
        async def on_push_frame(self, data: FramePushed) -> None:
            if isinstance(data.frame, InterruptionFrame) and data.destination is tts:
                cuts.append(time.monotonic())

    tts = ElevenLabsTTSService(
        api_key="unused",
        url=f"ws://127.0.0.1:{http_port}",  # the one option changed: the base URL
        settings=ElevenLabsTTSService.Settings(voice="default"),
        sample_rate=24_000,
    )
    words = [w + " " for w in ANSWER.split(" ")]
    frames: list[Any] = []
    for _ in range(args.rounds):
        frames += [LLMFullResponseStartFrame(), *(LLMTextFrame(w) for w in words), LLMFullResponseEndFrame()]
        frames += [SleepFrame(args.speak_s), InterruptionFrame(), SleepFrame(args.gap_s)]
    await run_test(tts, frames_to_send=frames, observers=[Cuts()])
    return sorted(set(cuts))


async def drive_livekit(http_port: int, args: argparse.Namespace) -> list[float]:
    """LiveKit's ElevenLabs TTS: each stream closed once its first audio came; returns the close times."""
    from livekit.plugins import elevenlabs as lk_elevenlabs

    cuts: list[float] = []
    async with aiohttp.ClientSession() as session:
        tts = lk_elevenlabs.TTS(
            api_key="unused",
            base_url=f"http://127.0.0.1:{http_port}/v1",  # the one option changed
            voice_id="default",
            encoding="pcm_24000",
            http_session=session,
        )
        try:
            for _ in range(args.rounds):
                stream = tts.stream()
                stream.push_text(ANSWER)  # the LLM is still answering: no flush, no end of input
                async with asyncio.timeout(30):
                    await anext(aiter(stream))  # its first audio
                await asyncio.sleep(args.speak_s)
                cuts.append(time.monotonic())
                await stream.aclose()
                await asyncio.sleep(args.gap_s)
        finally:
            await tts.aclose()
    return cuts


def summarize(delays: list[float | None], release_s: float) -> dict[str, Any]:
    """How fast the interruptions freed their streams."""
    got = sorted(d for d in delays if d is not None)
    return {
        "interruptions": len(delays),
        "released": len(got),
        "released_within": sum(1 for d in got if d <= release_s),
        "p50_s": got[len(got) // 2] if got else None,
        "p99_s": got[min(len(got) - 1, int(len(got) * 0.99))] if got else None,
        "max_s": got[-1] if got else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, drive each framework, SIGTERM; the results."""
    flags = ["--engine", "fake", "--fake-step-ms", str(args.fake_step_ms)]
    flags += ["--drain-timeout-s", str(args.drain_timeout_s), "--segment-lookahead", "0"]
    server = ServerProcess(flags)
    await server.start(timeout_s=120)
    http_port = server.port + 1
    sampler = ActiveSampler(f"http://127.0.0.1:{server.port}/metrics", args.sample_ms / 1000)
    sampler.start()
    clients: dict[str, Any] = {}
    try:
        for name in args.clients.split(","):
            drive = {"pipecat": drive_pipecat, "livekit": drive_livekit}[name]
            cuts = await drive(http_port, args)
            await asyncio.sleep(max(args.release_s, 0.5))  # the last interruption's release is sampled too
            clients[name] = summarize(release_delays(sampler.samples, cuts), args.release_s)
    finally:
        await sampler.stop()
        began = time.monotonic()
        code = await server.stop(timeout_s=args.drain_timeout_s + 30)
        exit_s = time.monotonic() - began
    checks = {
        f"{name}_every_interruption_freed_within_{args.release_s:g}_s": (
            c["released_within"] == c["interruptions"] == args.rounds
        )
        for name, c in clients.items()
    }
    checks["sigterm_exit_0_within_the_drain_timeout"] = code == 0 and exit_s <= args.drain_timeout_s
    return {
        "schema": "chattts-stream-interruptions/1",
        "machine": describe_machine(),
        "server": server.describe(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "clients": clients,
        "sigterm": {"exit_code": code, "exit_s": exit_s, "drain_timeout_s": args.drain_timeout_s},
        "checks": checks,
        "pass": all(checks.values()),
    }


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


def markdown(results: dict[str, Any]) -> str:
    """The report."""
    a = results["args"]
    cpu = results["machine"].get("cpu_model", "?")
    lines = [
        "# pipecat and LiveKit interrupting an ElevenLabs stream",
        "",
        f"`python -m bench.soak.interruptions --rounds {a['rounds']}`: {cpu}, "
        f"fake engine ({a['fake_step_ms']:g} ms steps), each answer cut after {a['speak_s']:g} s.",
        "",
        f"| framework | interruptions | freed within {a['release_s']:g} s | p50 | p99 | max |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in results["clients"].items():
        lines.append(
            f"| {name} | {c['interruptions']} | {c['released_within']} | {_fmt(c['p50_s'])} | "
            f"{_fmt(c['p99_s'])} | {_fmt(c['max_s'])} |"
        )
    s = results["sigterm"]
    lines += [
        "",
        f"SIGTERM afterwards: exit {s['exit_code']} in {s['exit_s']:.2f} s "
        f"(drain timeout {s['drain_timeout_s']:g} s).",
        "",
        "| check | |",
        "|---|---|",
        *(f"| {name} | {'pass' if ok else '**FAIL**'} |" for name, ok in results["checks"].items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run, write the results, print the report; exit 1 when a check fails."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results = asyncio.run(run(args))
    report = markdown(results)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(report)
    print(report)
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
