"""Chaos soak (issue #25): normal clients stream while hostile ones run every attack of the issue.

``python -m bench.chaos --duration-s 630 --out bench/results/chaos/<hw>`` starts one ``serve``
subprocess (fake engine, loopback only: WebSocket, HTTP and Wyoming ports, API keys with a
``normal`` and a ``hostile`` tenant, an allowed origin, ``--memory-budget-bytes``), then
alternates *quiet* windows (normal clients alone) and *attack* windows (normal clients while
one attack of :mod:`bench.chaos.attacks` runs in its own process from 127.0.0.2, the attacks in
rotation) until ``--duration-s`` seconds of attacks have run. The normal clients
(:mod:`bench.chaos.normal`) stream the whole time and check every stream. At the end, clients
that never read hold streams while the server gets SIGTERM (finding 4).

Pass/fail, computed and printed:

- zero lost or corrupted normal streams;
- normal time to first audio, p99 over the attack windows ≤ 2 × p99 over the quiet windows
  of the same run (interleaved, so a busy shared machine slows both alike);
- the server's RSS (sampled every ``--sample-interval-s``) under ``--budget-mib`` +
  ``--margin-mib`` throughout;
- open fds flat: idle after the load no more than idle before it;
- exit 0 on SIGTERM within ``--drain-timeout-s`` + 5 s, with never-reading clients connected.

Besides, for every attack: how many of its probes got the answer the issue expects. Writes
``OUT.json`` and ``OUT.md``; exit status 1 when a check fails, 2 when the server did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import secrets
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.chaos import report as chaos_report
from bench.chaos.attacks import ATTACKS
from bench.chaos.normal import Normal, http_worker, ws_worker
from bench.chaos.sockets import recording
from bench.harness.machine import describe_machine
from bench.harness.sampler import Sampler, fetch_metrics_text, read_gauges, samples_as_dicts
from bench.harness.servers import ServerProcess, child_env, free_port

SCHEMA = "chattts-stream-chaos/1"
ORIGIN = "https://app.example"
#: The attacks run in windows, in this order (finding 4, drain, runs at the end).
ROTATION = [name for number, (name, _) in sorted(ATTACKS.items()) if name != "drain"]
MIB = 1024 * 1024


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of attacks in all")
    p.add_argument("--attack-s", type=float, default=30.0, help="one attack window")
    p.add_argument("--quiet-s", type=float, default=12.0, help="one quiet window (before every attack)")
    p.add_argument("--attacks", default=",".join(ROTATION), help="attacks to rotate (comma-separated)")
    p.add_argument("--budget-mib", type=int, default=128, help="the server's --memory-budget-bytes, MiB")
    p.add_argument("--margin-mib", type=int, default=192, help="RSS allowed above the budget, MiB")
    p.add_argument("--drain-timeout-s", type=float, default=8.0, help="the server's --drain-timeout-s")
    p.add_argument("--ws-workers", type=int, default=3, help="normal WebSocket clients")
    p.add_argument("--http-workers", type=int, default=1, help="normal OpenAI-endpoint clients")
    p.add_argument("--pause-s", type=float, default=0.05, help="a normal client's pause between streams")
    p.add_argument("--sample-interval-s", type=float, default=0.5)
    p.add_argument("--server-flags", default="", help="further serve flags (shell-quoted)")
    p.add_argument("--out", type=Path, default=None, help="output stem: OUT.json and OUT.md")
    return p.parse_args(argv)


def server_flags(args: argparse.Namespace, keys_file: Path, http_port: int, wyoming_port: int) -> list[str]:
    """``serve`` flags of the server under test."""
    flags = ["--engine", "fake", "--http-port", str(http_port), "--wyoming-port", str(wyoming_port)]
    flags += ["--api-keys-file", str(keys_file), "--allowed-origins", ORIGIN]
    # The normal tenant's voice lives in the run's own folder, not in the user's cache.
    flags += ["--voices-dir", str(keys_file.parent / "voices")]
    flags += ["--memory-budget-bytes", str(args.budget_mib * 1024 * 1024), "--cache-bytes", "0"]
    flags += ["--resume-ttl-s", "5", "--drain-timeout-s", str(args.drain_timeout_s), "--max-queue", "64"]
    flags += ["--body-timeout-s", "5"]  # el_rest_slow's bodies take a minute
    flags += ["--log-level", "info"]
    return flags + shlex.split(args.server_flags)


async def upload_voice(http_url: str, key: str) -> str:
    """A voice of the normal tenant (the tenancy attack tries to use it); its id."""
    form = aiohttp.FormData()
    form.add_field("audio_sample", recording(), filename="me.wav", content_type="audio/wav")
    form.add_field("transcript", "这是一段参考录音。")
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{http_url}/v1/audio/voices", data=form, headers=headers) as resp,
    ):
        answer = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"uploading the normal tenant's voice: {resp.status} {answer}")
        return str(answer["id"])


class Soak:
    """One run: the server, the normal clients, the windows of attacks, the samples."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.argv = argv
        self.tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
        self.normal_key = f"normal-{secrets.token_hex(12)}"
        self.hostile_key = f"hostile-{secrets.token_hex(12)}"
        self.keys_file = self.tmp / "keys"
        self.keys_file.write_text(f"[normal]\n{self.normal_key}\n[hostile]\n{self.hostile_key}\n")
        self.http_port, self.wyoming_port = free_port(), free_port()
        self.log_path = self.tmp / "server.log"
        flags = server_flags(args, self.keys_file, self.http_port, self.wyoming_port)
        self.server = ServerProcess(flags, log_path=self.log_path)
        self.windows: list[dict[str, Any]] = []
        self.attacks: dict[str, dict[str, Any]] = {}
        self.tokens_file = self.tmp / "tokens.json"

    async def attack(self, kind: str, seconds: float, normal: Normal, voice: str) -> dict[str, Any]:
        """Run one attack in its own process; its tally."""
        argv = [sys.executable, "-m", "bench.chaos.attacks", kind, "--seconds", str(seconds)]
        argv += ["--ws-port", str(self.server.port), "--http-port", str(self.http_port)]
        argv += ["--wyoming-port", str(self.wyoming_port), "--key", self.hostile_key, "--origin", ORIGIN]
        argv += ["--victim-voice", voice, "--tokens-file", str(self.tokens_file)]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_env()
        )

        async def publish_tokens() -> None:  # the tenancy attack reads the normal streams' tokens
            partial = self.tokens_file.with_suffix(".partial")
            while True:
                partial.write_text(json.dumps(sorted(normal.live_tokens)))
                partial.replace(self.tokens_file)  # whole, never half-written
                await asyncio.sleep(0.2)

        publisher = asyncio.create_task(publish_tokens())
        try:
            out, err = await asyncio.wait_for(proc.communicate(), seconds + 90)
        except TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
        finally:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
        lines = out.decode().strip().splitlines()
        try:
            return dict(json.loads(lines[-1]))
        except (IndexError, ValueError):
            return {
                "kind": kind,
                "probes": 0,
                "expected": 0,
                "notes": {"no result": 1},
                "stderr": err.decode()[-800:],
            }

    async def run(self) -> dict[str, Any]:
        """Start the server, soak it, drain it; returns the results."""
        args = self.args
        await self.server.start()
        assert self.server.proc is not None
        pid = self.server.proc.pid
        metrics_url = f"http://127.0.0.1:{self.server.port}/metrics"
        http_url = f"http://127.0.0.1:{self.http_port}"
        normal = Normal(self.server.url, http_url, self.normal_key)
        voice = await upload_voice(http_url, self.normal_key)
        sampler = Sampler(pid, metrics_url, args.sample_interval_s, lambda: len(normal.records))
        normal.clock = sampler.now
        sampler.start()
        stop = asyncio.Event()
        exit_code: int | None = None
        drain: dict[str, Any] = {}
        try:
            await asyncio.sleep(3.0)  # idle before the load
            rotation = [a for a in args.attacks.split(",") if a]
            workers = [
                *(ws_worker(normal, f"ws{k}", stop, args.pause_s) for k in range(args.ws_workers)),
                *(http_worker(normal, f"http{k}", stop, args.pause_s) for k in range(args.http_workers)),
            ]
            async with asyncio.TaskGroup() as group:
                for worker in workers:
                    group.create_task(worker)
                attacked = 0.0
                while attacked < args.duration_s - 1e-6:
                    await self.window(normal, sampler, "quiet", args.quiet_s)
                    kind = rotation[len(self.windows) // 2 % len(rotation)]
                    seconds = min(args.attack_s, args.duration_s - attacked)
                    tally = await self.window(normal, sampler, kind, seconds, voice=voice)
                    self.merge(kind, tally)
                    attacked += seconds
                await self.window(normal, sampler, "quiet", args.quiet_s)
                stop.set()
            sampler.phase = "idle_after"
            await self.wait_idle(metrics_url)
            await asyncio.sleep(3.0)
            exit_code, drain = await self.drain_under_attack(normal, voice)
        finally:
            await sampler.stop()
            if exit_code is None:
                exit_code = await self.server.stop()
        self.judge_key_in_query()
        return self.results(normal, sampler, exit_code, drain)

    async def window(
        self, normal: Normal, sampler: Sampler, phase: str, seconds: float, *, voice: str = ""
    ) -> dict[str, Any]:
        """One window: ``quiet``, or an attack; the attack's tally."""
        normal.window = len(self.windows)
        normal.phase = phase
        sampler.phase = "quiet" if phase == "quiet" else f"attack:{phase}"
        began = sampler.now()
        print(f"bench.chaos: window {normal.window} {phase} at {began:.0f} s", file=sys.stderr, flush=True)
        if phase == "quiet":
            await asyncio.sleep(seconds)
            tally: dict[str, Any] = {}
        else:
            freed = await self.budget_frees()
            tally = await self.attack(phase, seconds, normal, voice)
            if phase == "memory":  # answered as expected: memory stayed within the budget + margin
                rss = max((s.rss_bytes for s in sampler.samples if s.t >= began), default=0) / MIB
                within = rss <= self.args.budget_mib + self.args.margin_mib
                tally["probes"], tally["expected"] = 1, int(within)
                tally["notes"][f"streams freed by the budget: {await self.budget_frees() - freed:.0f}"] = 1
                tally["notes"]["RSS within budget + margin" if within else "RSS past budget + margin"] = 1
        self.windows.append(
            {"index": normal.window, "phase": phase, "t0": began, "t1": sampler.now(), **tally}
        )
        return tally

    async def budget_frees(self) -> float:
        """Streams the server freed for its memory budget so far (``/metrics``)."""
        url = f"http://127.0.0.1:{self.server.port}/metrics"
        try:
            text = await asyncio.to_thread(fetch_metrics_text, url)
        except OSError:
            return 0.0
        line = next(
            (x for x in text.splitlines() if x.startswith('chattts_streams_total{reason="budget"}')), ""
        )
        return float(line.split()[-1]) if line else 0.0

    def merge(self, kind: str, tally: dict[str, Any]) -> None:
        """Add one window's tally to the attack's totals."""
        total = self.attacks.setdefault(kind, {"windows": 0, "probes": 0, "expected": 0, "notes": {}})
        total["windows"] += 1
        total["probes"] += tally.get("probes", 0)
        total["expected"] += tally.get("expected", 0)
        for note, n in tally.get("notes", {}).items():
            total["notes"][note] = total["notes"].get(note, 0) + n

    async def wait_idle(self, metrics_url: str, timeout_s: float = 60.0) -> None:
        """Until the server holds no stream and no connection (the TTL passes for detached ones)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            gauges = await read_gauges(metrics_url)
            if gauges.get("chattts_active_streams") == 0 and gauges.get("chattts_connections") == 0:
                return
            await asyncio.sleep(0.25)

    async def drain_under_attack(self, normal: Normal, voice: str) -> tuple[int | None, dict[str, Any]]:
        """Finding 4: never-reading clients hold streams; SIGTERM; the exit code and how long it took."""
        proc = self.server.proc
        assert proc is not None
        limit = self.args.drain_timeout_s + 5.0
        holder = asyncio.create_task(self.attack("drain", limit + 20.0, normal, voice))
        await asyncio.sleep(2.0)  # their streams are running, their sockets full
        began = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(limit + 25.0):
                code = await proc.wait()
        except TimeoutError:
            proc.kill()
            code = await proc.wait()
        took = time.perf_counter() - began
        tally = await holder
        self.merge("drain", tally)
        return code, {"exit_code": code, "exit_s": took, "limit_s": limit}

    def judge_key_in_query(self) -> None:
        """Finding 7: the key sent as ``?api_key=`` must not be in the server's log."""
        entry = self.attacks.get("key_in_query")
        if entry is None:
            return
        leaked = self.hostile_key in self.log_path.read_text(errors="replace")
        entry["notes"]["key in the server's log" if leaked else "key not in the server's log"] = 1
        entry["expected"] = 0 if leaked else entry["probes"]

    def results(
        self, normal: Normal, sampler: Sampler, exit_code: int | None, drain: dict[str, Any]
    ) -> dict[str, Any]:
        """The JSON document: config, samples, records, windows, attacks, checks."""
        args = self.args
        judged = chaos_report.judge(
            normal.as_dicts(),
            samples_as_dicts(sampler.samples),
            budget_mib=args.budget_mib,
            margin_mib=args.margin_mib,
            drain=drain,
        )
        return {
            "schema": SCHEMA,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "-m", "bench.chaos", *self.argv]),
            "machine": describe_machine(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "server": {**self.server.describe(), "log": str(self.log_path)},
            "attacks": self.attacks,
            "windows": self.windows,
            **judged,
            "drain": drain,
            "exit_code": exit_code,
            "records": normal.as_table(),
            "samples": samples_as_dicts(sampler.samples),
        }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.chaos``: run, write JSON and markdown, exit 1 when a check fails."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    unknown = [a for a in args.attacks.split(",") if a and a not in ROTATION]
    if unknown:
        print(f"bench.chaos: unknown attacks {unknown}; choose from {ROTATION}", file=sys.stderr)
        return 2
    soak = Soak(args, argv)
    try:
        import uvloop

        results = uvloop.run(soak.run())
    except RuntimeError as exc:
        print(f"bench.chaos: {exc}", file=sys.stderr)
        return 2
    out: Path = args.out or soak.tmp / "chaos"
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".md")
    # One line per top-level key: readable enough, and small for tens of thousands of records.
    body = ",\n".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in results.items())
    json_path.write_text("{\n" + body + "\n}\n", encoding="utf-8")
    md = chaos_report.markdown(results)
    md_path.write_text(md, encoding="utf-8")
    print(md)
    print(f"bench.chaos: wrote {json_path} and {md_path}", file=sys.stderr)
    with contextlib.suppress(OSError):
        (soak.tmp / "tokens.json").unlink()
    return 0 if results["acceptance"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
