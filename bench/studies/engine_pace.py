"""The engine's pace under a full front-end load: one process against ``--engine-process``.

The fake engine runs each step as a GPU engine does, four quanta of Python host work
(``--fake-host-ms``, holding the GIL) each followed by its device time (a sleep), and
measures how long its steps were held off a core they could have run on
(``chattts_engine_host_held_seconds``: wall time less sleep, CPU time and run-queue wait, so
a busy machine does not count, only another thread holding the GIL). The share of the
steps' wall time held off is the pace the front end takes from the engine: its quanta per
second under load are that much below its pace with no clients (which is held off by
nothing). Opus listeners on real WebSockets, in the server's own process and event loop (they
load the front end as clients on other machines would, plus their own decoding-free reads),
start streams back to back; a measure is the median of ``--windows`` one-second windows.

The forms are measured interleaved (one, then the other, ``--rounds`` times), so load from
other processes on the machine hits both alike.

Usage::

    python -m bench.studies.engine_pace [--rounds 3] [--streams 64] \\
        [--out bench/results/studies/engine-pace-<hw>]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from bench.harness.machine import result_stem, write_result
from server.app import App
from server.config import load_settings
from tests.wsclient import open_client, recv, start

#: A step: 5 ms of device time and 2 ms of Python host work, in four quanta; no cost per row,
#: so the quanta a second do not depend on the batch.
ENGINE = ("--engine", "fake", "--fake-step-ms", "5", "--fake-row-ms", "0", "--fake-host-ms", "2")
TEXT = "A long sentence that keeps the front end encoding Opus for a while. " * 6
HELD = "chattts_engine_host_held_seconds"
STEPS = "chattts_block_seconds_sum"
COUNT = "chattts_block_seconds_count"


def settings_for(*flags: str) -> list[str]:
    voices = Path(tempfile.gettempdir()) / f"chattts-pace-voices-{uuid.uuid4().hex}"
    return [
        *ENGINE,
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--voices-dir",
        str(voices),
        "--max-batch",
        "64",
        *flags,
    ]


def totals(app: App) -> dict[str, float]:
    """The engine's running totals now (from this process's /metrics text)."""
    values = {}
    for line in app.metrics.render().decode().splitlines():
        name, _, value = line.partition(" ")
        if name in (HELD, STEPS, COUNT):
            values[name] = float(value)
    return values


async def listener(port: int, stop: asyncio.Event, index: int) -> int:
    """Opus streams back to back until ``stop``; the frames received."""
    ws, _ = await open_client(port)
    frames, n = 0, 0
    try:
        while not stop.is_set():
            await start(ws, id=f"s{n}", text=TEXT, seed=index * 1000 + n, format="opus")
            while True:
                raw = await recv(ws)
                if isinstance(raw, bytes):
                    frames += 1
                elif json.loads(raw)["type"] in ("done", "error"):
                    break
            n += 1
    finally:
        await ws.close()
    return frames


def held_share(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The share of the steps' wall time held off a core between two totals (None: no steps)."""
    step_s = after[STEPS] - before[STEPS]
    return (after[HELD] - before[HELD]) / step_s if step_s > 0 else None


async def measure(app: App, streams: int, windows: int) -> dict[str, float]:
    """With ``streams`` listeners on ``app``: the median held share of its windows, quanta a second."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(listener(app.port, stop, i)) for i in range(streams)]
    try:
        await asyncio.sleep(0.5)  # every listener has started a stream
        first = before = totals(app)
        shares = []
        for _ in range(windows):
            await asyncio.sleep(1.0)
            after = totals(app)
            share = held_share(before, after)
            if share is not None:
                shares.append(share)
            before = after
    finally:
        stop.set()
        frames = sum(await asyncio.gather(*tasks))
    step_s = before[STEPS] - first[STEPS]
    quanta = 4 * (before[COUNT] - first[COUNT])
    return {
        "held_share": statistics.median(shares) if shares else float("nan"),
        "windows": len(shares),
        "step_s": step_s,
        # Quanta per second of stepping (the engine also idles between streams under this load).
        "quanta_per_step_s": quanta / step_s if step_s else float("nan"),
        "frames": frames,
    }


async def run_form(flags: list[str], streams: int, windows: int) -> dict[str, float]:
    app = App(load_settings(settings_for(*flags), env={}))
    await app.start()
    try:
        await asyncio.wait_for(app.warmed_up.wait(), 60)
        quiet = await measure(app, 1, windows)
        loaded = await measure(app, streams, windows)
    finally:
        await app.stop()
    return {"quiet": quiet, "loaded": loaded}  # type: ignore[dict-item]


FORMS = {"one process": [], "--engine-process": ["--engine-process"]}


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    runs: dict[str, list[dict[str, float]]] = {form: [] for form in FORMS}
    for _ in range(args.rounds):
        for form, flags in FORMS.items():
            runs[form].append(await run_form(flags, args.streams, args.windows))
            print(form, json.dumps(runs[form][-1]), flush=True)
    return {"runs": runs}


def report(results: dict[str, object], args: argparse.Namespace, command: str) -> str:
    runs: dict[str, list[dict[str, dict[str, float]]]] = results["runs"]  # type: ignore[assignment]
    lines = [
        "# The engine's pace under a full front-end load (fake engine, host work in Python)",
        "",
        f"`{command}`; {args.streams} Opus listeners in the front end's process, back to back; each "
        f"figure the median of {args.windows} one-second windows; forms interleaved, {args.rounds} rounds.",
        "",
        "| form | round | held share quiet (1 stream) | held share loaded "
        "| quanta per step-second quiet | loaded | frames |",
        "|---|---|---|---|---|---|---|",
    ]
    for form, rounds in runs.items():
        for i, run in enumerate(rounds, 1):
            q, l_ = run["quiet"], run["loaded"]
            lines.append(
                f"| {form} | {i} | {q['held_share']:.1%} | **{l_['held_share']:.1%}** | "
                f"{q['quanta_per_step_s']:.0f} | {l_['quanta_per_step_s']:.0f} | {l_['frames']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--out", default=str(result_stem("studies", "engine-pace")))
    args = parser.parse_args()
    import uvloop

    results = uvloop.run(main_async(args))
    command = "python -m bench.studies.engine_pace " + " ".join(sys.argv[1:])
    write_result(Path(args.out), command, results, report(results, args, command))


if __name__ == "__main__":
    main()
