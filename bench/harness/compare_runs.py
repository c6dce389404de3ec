"""One table from several ``python -m bench`` runs' JSONs: streams held, under-runs, cores, CPU cost.

Used for A/B runs of server forms taken interleaved on one machine (one process against
``--frontend-processes 2``): ``python -m bench.harness.compare_runs NAME=PATH.json ...``
prints a Markdown table, one row per run and scenario, and with ``--json OUT`` writes the
numbers it read. "Cores used" is the server's CPU seconds (its child processes included:
``servers.process_cpu_s``) over the scenario's wall seconds; "client cores" the load client's
(runs before it was recorded show "-").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

THRESHOLD_MS = 300.0


def rows(name: str, run: dict[str, Any]) -> list[dict[str, Any]]:
    """The numbers of each scenario of one run."""
    found = []
    for scenario in run["scenarios"]:
        summary = scenario["summary"]
        throughput = summary["throughput"]
        (listener,) = [x for x in summary["listener"] if x["threshold_ms"] == THRESHOLD_MS]
        found.append(
            {
                "run": name,
                "scenario": scenario["label"],
                "streams": summary["streams"],
                "errors": summary["errors"],
                "underrun_streams_300ms": listener["streams_with_underruns"],
                "audio_s_per_cpu_s": throughput["audio_s_per_cpu_s"],
                "cores_used": throughput["cpu_s"] / throughput["wall_s"],
                "client_cores": throughput.get("client_cores"),
                "audio_s_per_wall_s": throughput["steady_audio_s_per_wall_s"],
                "ttfa_p99_s": summary["ttfa_s"]["p99"],
                "loadavg_1m_after": scenario["loadavg_1m_after"],
            }
        )
    return found


def table(found: list[dict[str, Any]]) -> str:
    """The Markdown table of :func:`rows`."""
    lines = [
        "| run | scenario | streams | errors | streams under-run at 300 ms | audio-s per server CPU-s "
        "| cores used | client cores | audio-s per wall-s | first audio p99 (s) | load avg after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none"
        client = "-" if r["client_cores"] is None else f"{r['client_cores']:.2f}"
        lines.append(
            f"| {r['run']} | {r['scenario']} | {r['streams']} | {errors} | {r['underrun_streams_300ms']} "
            f"| {r['audio_s_per_cpu_s']:.1f} | {r['cores_used']:.2f} | {client} "
            f"| {r['audio_s_per_wall_s']:.1f} "
            f"| {r['ttfa_p99_s']:.2f} | {r['loadavg_1m_after']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=PATH of a run's JSON, in the order they ran")
    parser.add_argument("--json", type=Path, help="write the numbers here too")
    args = parser.parse_args()
    found: list[dict[str, Any]] = []
    for spec in args.runs:
        name, _, path = spec.partition("=")
        found += rows(name, json.loads(Path(path).read_text()))
    print(table(found))
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
