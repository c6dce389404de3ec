"""Does a lower CPU priority for the front-end processes keep the engine's pace under load?

``--frontend-processes 2`` on the fake engine with its host work in Python (the engine-pace
study's engine: 5 ms of device time and 2 ms of Python host work a step, in four quanta), at
each ``--frontend-priority``: ``same`` (the engine's), ``lower`` (nice 10) and
``idle`` (``SCHED_IDLE``, what the default ``auto`` picks for this engine). Opus listeners in a process
of their own (``--listen``, run at nice 10 in every form: they stand in for clients on other
machines, and must not take the engine's core themselves) keep both front ends busy, back to
back. The engine's pace is its quanta per step-second (four quanta a step over the steps'
wall time, read from ``/metrics``, which includes any wait for a core): quiet (one listener)
and loaded. The issue's bar: loaded at most 5 % below quiet.

The forms are measured interleaved (one, then the other, ``--rounds`` times), so load from
other processes on the machine hits both alike.

Usage::

    python -m bench.studies.frontend_priority [--rounds 3] [--priorities same,lower,idle] \\
        [--streams 32] [--seconds 6] [--out bench/results/studies/frontend-priority-<hw>]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import urllib.request
import uuid
from pathlib import Path

from bench.harness.machine import result_stem, write_result
from bench.studies.engine_pace import COUNT, ENGINE, STEPS, listener
from tests.serverproc import free_port, spawn_server, wait_ready

#: The listeners' nice value in every form (see the module docstring).
LISTENER_NICE = 10
#: The default of ``--frontend-priority`` (the form that says "(default)").
DEFAULT_PRIORITY = "idle"  # what auto is for this engine (no model on the CPU)


def form_name(priority: str) -> str:
    return f"--frontend-priority {priority}" + (" (default)" if priority == DEFAULT_PRIORITY else "")


def totals(port: int) -> dict[str, float]:
    """The engine's step totals now, from the merged ``/metrics`` (blocking: call it in a thread)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (STEPS, COUNT):
            values[name] = float(value)
    return values


async def listen(port: int, streams: int, seconds: float) -> int:
    """``--listen``: ``streams`` Opus listeners for ``seconds``; the frames they received."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(listener(port, stop, i)) for i in range(streams)]
    await asyncio.sleep(seconds)
    stop.set()
    return sum(await asyncio.gather(*tasks))


async def measure(port: int, streams: int, seconds: float) -> dict[str, float]:
    """Listeners for ``seconds``; the engine's quanta per step-second over their last part."""
    clients = await asyncio.create_subprocess_exec(
        "nice", "-n", str(LISTENER_NICE), sys.executable, "-m", "bench.studies.frontend_priority",
        "--listen", str(port), "--streams", str(streams), "--seconds", str(seconds),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await asyncio.sleep(1.5)  # the listeners' process has started and every listener streams
        before = await asyncio.to_thread(totals, port)
        await asyncio.sleep(seconds - 2.0)
        after = await asyncio.to_thread(totals, port)
        out, _ = await asyncio.wait_for(clients.communicate(), 60)
    finally:
        if clients.returncode is None:
            clients.kill()
            await clients.wait()
    step_s = after[STEPS] - before[STEPS]
    quanta = 4 * (after[COUNT] - before[COUNT])
    return {"quanta_per_step_s": quanta / step_s if step_s else float("nan"), "frames": int(out)}


async def run_form(priority: str, streams: int, seconds: float) -> dict[str, dict[str, float]]:
    port = free_port()
    voices = Path(tempfile.gettempdir()) / f"chattts-nice-voices-{uuid.uuid4().hex}"
    flags = [*ENGINE, "--port", str(port), "--voices-dir", str(voices), "--max-batch", "64"]
    proc = await spawn_server(
        *flags, "--frontend-processes", "2", "--frontend-priority", priority, env=dict(os.environ)
    )
    try:
        await wait_ready(port, proc)
        await asyncio.sleep(2.0)  # the second child is ready too (each binds before it is)
        quiet = await measure(port, 1, seconds)
        loaded = await measure(port, streams, seconds)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return {"quiet": quiet, "loaded": loaded}


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    priorities = args.priorities.split(",")
    runs: dict[str, list[dict[str, dict[str, float]]]] = {form_name(p): [] for p in priorities}
    for _ in range(args.rounds):
        for priority in priorities:
            form = form_name(priority)
            runs[form].append(await run_form(priority, args.streams, args.seconds))
            print(form, json.dumps(runs[form][-1]), flush=True)
    return {"runs": runs}


def report(results: dict[str, object], args: argparse.Namespace, command: str) -> str:
    runs: dict[str, list[dict[str, dict[str, float]]]] = results["runs"]  # type: ignore[assignment]
    lines = [
        "# The engine's pace under busy front-end processes, by their CPU priority (`--frontend-priority`)",
        "",
        f"`{command}`; fake engine with Python host work, `--frontend-processes 2`; {args.streams} "
        f"Opus listeners (nice {LISTENER_NICE}) back to back; {args.seconds - 2.0:.0f} s measured a "
        f"form and load; forms interleaved, {args.rounds} rounds.",
        "",
        "| form | round | quanta per step-second quiet (1 stream) | loaded | loaded ÷ quiet | frames |",
        "|---|---|---|---|---|---|",
    ]
    for form, rounds in runs.items():
        for i, run in enumerate(rounds, 1):
            q, l_ = run["quiet"]["quanta_per_step_s"], run["loaded"]["quanta_per_step_s"]
            lines.append(
                f"| {form} | {i} | {q:.0f} | {l_:.0f} | **{l_ / q:.2f}** | {run['loaded']['frames']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=6.0, help="each measure's listeners run this long")
    parser.add_argument("--priorities", default="same,lower,idle", help="the forms' --frontend-priority")
    parser.add_argument("--listen", type=int, default=0, help="internal: be the listeners on this port")
    parser.add_argument("--out", default=str(result_stem("studies", "frontend-priority")))
    args = parser.parse_args()
    import uvloop

    if args.listen:
        print(uvloop.run(listen(args.listen, args.streams, args.seconds)))
        return
    results = uvloop.run(main_async(args))
    command = "python -m bench.studies.frontend_priority " + " ".join(sys.argv[1:])
    write_result(Path(args.out), command, results, report(results, args, command))


if __name__ == "__main__":
    main()
