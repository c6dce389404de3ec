"""What forwarding a resume costs: a resume served by the owner against one forwarded to it (issue #24).

Two replicas in this process (fake engine, a shared resume secret, no response cache). Each
round starts ``--streams`` streams on replica A, lets A generate them to the end (so that
only delivery is measured, not the model), cuts every connection after its first frame, and
resumes them all either on A itself (direct: the baseline) or on replica B (forwarded: B
connects to A and relays). The two kinds alternate round by round, so that load from other
processes hits both alike. Measured per kind: time from ``resume`` to ``resumed``, to the
first frame and to ``done``, and the CPU time of this process (both replicas and the
clients) per stream; the ratios are forwarded / direct.

Usage::

    python -m bench.studies.forward_cost [--rounds 20] [--streams 8] \\
        [--out bench/results/studies/forward-cost-<hw>]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.machine import describe_machine, result_stem
from server.app import App
from server.config import load_settings

SECRET = "bench-forward-cost-secret-0123456789"
TEXT = " ".join(["The first sentence of a long answer.", "第二句话在这里。", "And a third that ends it."] * 4)


async def _recv(ws: Any) -> Any:
    async with asyncio.timeout(30):
        return await ws.recv()


async def _started_and_cut(port: int, n: int) -> tuple[str, int]:
    """Start a stream, take its first frame, drop the connection; its token and last seq."""
    from websockets.asyncio.client import connect

    ws = await connect(f"ws://127.0.0.1:{port}/v1/stream", compression=None, max_size=None)
    await _recv(ws)  # hello
    await ws.send(json.dumps({"type": "start", "id": f"s{n}", "text": TEXT, "seed": n}))
    token = json.loads(await _recv(ws))["stream"]
    while not isinstance(await _recv(ws), bytes):
        pass
    ws.transport.abort()
    return token, 0


async def _resume(port: int, token: str, after_seq: int) -> dict[str, float]:
    """Resume on ``port`` and take the rest; seconds to ``resumed``, first frame and ``done``."""
    from websockets.asyncio.client import connect

    ws = await connect(f"ws://127.0.0.1:{port}/v1/stream", compression=None, max_size=None)
    await _recv(ws)
    begin = time.perf_counter()
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": after_seq}))
    times: dict[str, float] = {}
    frames = 0
    while True:
        raw = await _recv(ws)
        now = time.perf_counter() - begin
        if isinstance(raw, bytes):
            frames += 1
            times.setdefault("first_frame_s", now)
            continue
        kind = json.loads(raw)["type"]
        if kind == "resumed":
            times["resumed_s"] = now
        elif kind == "done":
            times["done_s"] = now
            break
        elif kind == "error":
            raise RuntimeError(raw)
    await ws.close()
    times["frames"] = frames
    return times


async def _round(a: App, b: App, streams: int, forwarded: bool, round_no: int) -> dict[str, Any]:
    cut = await asyncio.gather(*(_started_and_cut(a.port, round_no * 1000 + n) for n in range(streams)))
    async with asyncio.timeout(60):
        # Generation ends inside the engine loop; polling the registry here is the simplest wait.
        while any((s := a.service.registry.get(t)) is None or not s.outbox.ended for t, _ in cut):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    target = b.port if forwarded else a.port
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    results = await asyncio.gather(*(_resume(target, token, seq) for token, seq in cut))
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    return {"results": results, "cpu_s_per_stream": cpu / streams, "wall_s": wall}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--engine", "fake", "--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
    flags += [
        "--resume-secret",
        SECRET,
        "--cache-bytes",
        "0",
        "--fake-step-ms",
        "1",
        "--log-level",
        "warning",
    ]
    a, b = App(load_settings(flags, env={})), App(load_settings(flags, env={}))
    await a.start()
    await b.start()
    try:
        kinds: dict[str, list[dict[str, Any]]] = {"direct": [], "forwarded": []}
        for r in range(args.rounds):
            for kind in ("direct", "forwarded") if r % 2 == 0 else ("forwarded", "direct"):
                kinds[kind].append(
                    await _round(a, b, args.streams, kind == "forwarded", r * 2 + len(kinds[kind]))
                )
        forwarded_count = b.metrics.resumes.labels(how="forwarded")._value.get()
    finally:
        await b.stop()
        await a.stop()
    summary: dict[str, Any] = {}
    for kind, rounds in kinds.items():
        per_stream = [res for rnd in rounds for res in rnd["results"]]
        summary[kind] = {
            key: statistics.median(res[key] for res in per_stream)
            for key in ("resumed_s", "first_frame_s", "done_s", "frames")
        } | {"cpu_s_per_stream": statistics.median(rnd["cpu_s_per_stream"] for rnd in rounds)}
    ratios = {
        key: summary["forwarded"][key] / summary["direct"][key]
        for key in ("resumed_s", "first_frame_s", "done_s", "cpu_s_per_stream")
    }
    return {"summary": summary, "ratios": ratios, "forwarded_resumes": forwarded_count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--out", default=str(result_stem("studies", "forward-cost")))
    args = parser.parse_args()
    machine = describe_machine()
    result = uvloop.run(run(args))
    machine["loadavg_at_end"] = list(os.getloadavg())
    command = "python -m bench.studies.forward_cost " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.with_suffix(".json").write_text(
        json.dumps({"command": command, "machine": machine, **result}, indent=1)
    )
    s, r = result["summary"], result["ratios"]
    lines = [
        "# Forwarded resume against a resume on the owner (fake engine, CPU)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine['cpu_model']}, {machine['cpu_cores']} cores, "
        f"load {machine['loadavg_at_start']} → {machine['loadavg_at_end']} (shared with other test runs)",
        "",
        f"{args.streams} streams per round, each generated to its end on replica A, cut after its first "
        f"frame, then resumed all at once on A (direct) or on B (forwarded to A); {args.rounds} rounds of "
        "each, alternating. Medians per stream (times from sending `resume`); CPU: this process "
        "(both replicas and the clients) per stream, median of the rounds.",
        "",
        "| | to `resumed` (ms) | to first frame (ms) | to `done` (ms) | frames | CPU ms per stream |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("direct", "forwarded"):
        k = s[kind]
        lines.append(
            f"| {kind} | {1000 * k['resumed_s']:.2f} | {1000 * k['first_frame_s']:.2f} | "
            f"{1000 * k['done_s']:.1f} | {k['frames']:.0f} | {1000 * k['cpu_s_per_stream']:.1f} |"
        )
    lines.append(
        f"| forwarded / direct | {r['resumed_s']:.2f} | {r['first_frame_s']:.2f} | {r['done_s']:.2f} | | "
        f"{r['cpu_s_per_stream']:.2f} |"
    )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
