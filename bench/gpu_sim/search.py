"""``python -m bench.gpu_sim``: the server's policy and engine core on a simulated H100 (issue #43).

No GPU is needed: the real :class:`~server.core.engine_core.EngineCore` and
:class:`~server.core.policy.SchedulingPolicy` run on a virtual clock over an engine that
charges an H100 cost model for the device (:mod:`bench.gpu_sim.model`, every constant named
with its source in the H200 results), while the host's work is charged at the CPU time it
really takes on this machine. Listeners play every stream in real time from its first audio::

    python -m bench.gpu_sim                         # writes bench/results/gpu_sim/h100.json and .md
    python -m bench.gpu_sim --levels 8,16 --duration-s 6 --no-bisect --out /tmp/sim   # seconds

Per level (``--levels``, each with every ``--arrivals``: ``burst``, all at once; ``poisson``,
``N`` listeners on average): first audio p50/p99, streams that under-ran at 300 and 100 ms of
buffer, quanta per second, rows per quantum, the device's and the host's time per quantum.
Then a bisection over Poisson levels for the most streams the model predicts, and what
limits it. It is a model, not a measurement: ``bench.gpu`` on a GPU is the measurement.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.gpu_sim.level import TTFA_P99_LIMIT_S, SimSettings, dump, mean_stream_s, run_level
from bench.gpu_sim.model import CostModel
from bench.gpu_sim.report import render
from bench.harness.machine import RESULTS_DIR, describe_machine
from bench.harness.textset import DEFAULT_TEXTS, load_texts
from server.core.policy import PolicyConfig

#: The longest KV slot the H200 run reserved: the longest prompt plus --segment-max-tokens 2048.
SLOT_POSITIONS = 3120


def _shown(path: Path) -> str:
    """A path as the report shows it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        return str(path)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench.gpu_sim`` arguments."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="128,256,384,512", help="concurrent listeners per level")
    p.add_argument("--arrivals", default="burst,poisson", help="burst (all at once), poisson (steady)")
    p.add_argument("--duration-s", type=float, default=40.0, help="virtual seconds of Poisson arrivals")
    p.add_argument("--quantum", type=int, default=4, help="tokens every row advances per quantum (K)")
    p.add_argument("--no-overlap", action="store_true", help="read each quantum before launching the next")
    p.add_argument("--host-scale", type=float, default=1.0, help="multiply the measured host CPU time")
    p.add_argument("--block-schedule", default="8,16,20,20,24,24,28,32", help="the server's --block-schedule")
    p.add_argument("--slot-positions", type=int, default=SLOT_POSITIONS, help="positions of one KV slot")
    p.add_argument("--max-batch", type=int, help="the policy's batch limit (default: the KV slots that fit)")
    p.add_argument("--max-queue", type=int, default=256, help="the server's --max-queue")
    p.add_argument("--lookahead", type=int, default=1, help="the server's --segment-lookahead")
    p.add_argument("--lead-s", type=float, default=1.0, help="the server's --lookahead-lead-s")
    p.add_argument("--no-bisect", action="store_true", help="skip the search for the most streams")
    p.add_argument(
        "--no-what-if", action="store_true", help="skip the searches with look-ahead off and unbounded places"
    )
    p.add_argument("--bisect-max", type=int, default=2048, help="the search's ceiling")
    p.add_argument("--bisect-step", type=int, default=32, help="the search's resolution")
    p.add_argument("--seed", type=int, default=43)
    p.add_argument("--note", default="", help="what changed since the last committed run (for the report)")
    p.add_argument("--texts", type=Path, default=DEFAULT_TEXTS, help="the streams' texts (.jsonl)")
    p.add_argument(
        "--out", type=Path, default=RESULTS_DIR / "gpu_sim" / "h100", help="writes OUT.json, OUT.md"
    )
    return p


def settings_of(args: argparse.Namespace, model: CostModel) -> SimSettings:
    """The levels' settings from the arguments."""
    slots = model.kv_slots(args.slot_positions)
    policy = PolicyConfig(
        max_batch=args.max_batch or slots,
        max_queue=args.max_queue,
        lookahead=args.lookahead,
        lookahead_lead_s=args.lead_s,
    )
    return SimSettings(
        model=model,
        policy=policy,
        quantum=args.quantum,
        overlap=not args.no_overlap,
        host_scale=args.host_scale,
        slots=slots,
        duration_s=args.duration_s,
        seed=args.seed,
        schedule=tuple(int(x) for x in args.block_schedule.split(",")),
    )


def limit_of(level: dict[str, Any], settings: SimSettings) -> str:
    """Why a level failed, in words, from its figures: the rule it broke, then the cause."""
    broke = []
    if level["refused"]:
        broke.append(
            f"admission refused {level['refused']} streams (--max-queue {settings.policy.max_queue})"
        )
    under = level["listeners"]["300"]["streams_with_underruns"]
    if under:
        broke.append(f"{under} streams under-ran at 300 ms")
    p99 = level["ttfa_ms"]["p99"]
    if p99 is not None and p99 > TTFA_P99_LIMIT_S * 1000:
        broke.append(f"first audio p99 {p99} ms")
    causes = []
    places = min(settings.slots, settings.policy.max_batch)
    if level["peak_slots"] >= places:
        causes.append(
            f"every batch place was taken at its peak ({level['peak_slots']} rows: --max-batch "
            f"{settings.policy.max_batch}, {settings.slots} KV slots) while {level['rows_per_quantum']} "
            f"rows stepped per quantum on average ({level.get('yielded_rows', 0)} look-ahead rows gave "
            "their places to newcomers): newcomers waited for a place"
        )
    device_ms = sum(level["device_ms_per_quantum"].values())
    first = settings.schedule[0]
    side = "the device" if device_ms >= level["host_ms_per_quantum"] else "the host"
    causes.append(
        f"{side} sets a quantum's pace: device {device_ms:.1f} ms, host {level['host_ms_per_quantum']:.1f} "
        f"ms a quantum, so a newcomer's first {first} tokens ({first // settings.quantum} quanta at K = "
        f"{settings.quantum}, read one quantum later) take longer; "
        f"rows still run at {level['row_rtf']} of real time"
    )
    return f"{', '.join(broke) or 'nothing'}; because " + "; ".join(causes)


def bisect(
    passed: int,
    failed: int | None,
    args: argparse.Namespace,
    texts: list[Any],
    settings: SimSettings,
    log: Any,
) -> dict[str, Any]:
    """The most Poisson listeners that pass, between a passing and a failing level (or the ceiling)."""
    probes: list[dict[str, Any]] = []
    hi_level: dict[str, Any] | None = None
    if failed is None:  # every level passed: double until one fails
        n = passed
        while n < args.bisect_max:
            n = min(2 * n, args.bisect_max)
            level = run_level(n, "poisson", texts, settings)
            probes.append(level)
            log(level)
            if not level["passed"]:
                failed, hi_level = n, level
                break
            passed = n
    while failed is not None and failed - passed > args.bisect_step:
        n = (passed + failed) // 2
        level = run_level(n, "poisson", texts, settings)
        probes.append(level)
        log(level)
        if level["passed"]:
            passed = n
        else:
            failed, hi_level = n, level
    return {
        "most_streams": passed,
        "first_failing": failed,
        "limit": limit_of(hi_level, settings) if hi_level is not None else "not reached below the ceiling",
        "probes": probes,
    }


def what_if(
    passed: int, args: argparse.Namespace, texts: list[Any], settings: SimSettings, log: Any
) -> list[dict[str, Any]]:
    """The search again with one thing changed, to show what the batch places cost."""
    policy = settings.policy
    variants = {
        "look-ahead off (--segment-lookahead 0)": replace(settings, policy=replace(policy, lookahead=0)),
        "batch places unbounded (4096 KV slots and --max-batch)": replace(
            settings, slots=4096, policy=replace(policy, max_batch=4096)
        ),
        "overlap off (each quantum read before the next is launched)": replace(settings, overlap=False),
        "a first block of 4 tokens (--block-schedule 4,12,20,20,24,24,28,32)": replace(
            settings, schedule=(4, 12, 20, 20, 24, 24, 28, 32)
        ),
    }
    out = []
    for name, variant in variants.items():
        found = bisect(passed, None, args, texts, variant, log)
        out.append({"change": name, **found})
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the levels and the search; write the JSON and the report."""
    args = build_parser().parse_args(argv)
    model = CostModel()
    settings = settings_of(args, model)
    texts = load_texts(args.texts)
    levels_n = [int(x) for x in args.levels.split(",") if x.strip()]
    arrivals = [a.strip() for a in args.arrivals.split(",") if a.strip()]
    started = time.monotonic()

    def log(level: dict[str, Any]) -> None:
        print(
            f"[gpu_sim] {level['arrival']} {level['streams']}: first audio p50/p99 "
            f"{level['ttfa_ms']['p50']}/{level['ttfa_ms']['p99']} ms, under-ran@300 "
            f"{level['listeners']['300']['streams_with_underruns']}, refused {level['refused']}, "
            f"{level['quanta_per_s']} quanta/s, {level['rows_per_quantum']} rows/quantum, "
            f"{'pass' if level['passed'] else 'FAIL'} ({level['sim_cpu_s']} s CPU)",
            flush=True,
        )

    levels = []
    for n in levels_n:
        for arrival in arrivals:
            level = run_level(n, arrival, texts, settings)
            log(level)
            levels.append(level)
    search: dict[str, Any] | None = None
    poisson = [lv for lv in levels if lv["arrival"] == "poisson"]
    if not args.no_bisect and poisson:
        passing = [lv["streams"] for lv in poisson if lv["passed"]]
        failing = [lv["streams"] for lv in poisson if not lv["passed"]]
        lo = max(passing, default=0)
        hi = min((n for n in failing if n > lo), default=None)
        if lo:
            search = bisect(lo, hi, args, texts, settings, log)
            if hi is not None and search["first_failing"] == hi and not search["probes"]:
                search["limit"] = limit_of(next(lv for lv in poisson if lv["streams"] == hi), settings)
            if not args.no_what_if:
                search["what_if"] = what_if(search["most_streams"], args, texts, settings, log)
    results = {
        "command": "python -m bench.gpu_sim " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": model.__dict__,
        "design": {
            "quantum_tokens": settings.quantum,
            "overlap": settings.overlap,
            "host_scale": settings.host_scale,
            "block_schedule": list(settings.schedule),
            "slot_positions": args.slot_positions,
            "kv_slots": settings.slots,
            "policy": settings.policy.__dict__,
            "mean_stream_s": round(mean_stream_s(texts), 2),
            "texts": _shown(args.texts),
            "ttfa_p99_limit_ms": TTFA_P99_LIMIT_S * 1000,
        },
        "levels": levels,
        "search": search,
        "sim_wall_s": round(time.monotonic() - started, 1),
        "note": args.note,
        "machine": describe_machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(dump(results))
    args.out.with_suffix(".md").write_text(render(results))
    print(f"[gpu_sim] wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
