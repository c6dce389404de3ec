"""The markdown of :mod:`bench.cpu`: the targets, the servers, the ratios.

The step's part (its rows, splits and targets) is :mod:`bench.cpu.step_report`.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.cpu.cells import LOADED, fmt, load_note
from bench.cpu.step_report import step_tables, step_targets

LONG_S = 4.0  # "streams of at least 4 s"
LISTENER_MS = 300.0
#: The in-process engine each server is compared with at c8 (the same flags, no server); a
#: server whose engine was not measured in the run gets no ratio rather than one against other
#: flags.
SERVER_ENGINE = {
    "after": "engine-direct-compiled-w8a8",  # the defaults: --profile realtime (x86-64 CPU)
    "after-eager": "engine-direct",
    "after-int8": "engine-direct-int8",
    "after-w8a8": "engine-direct-w8a8",
    "after-compiled": "engine-direct-compiled",
    "after-compiled-int8": "engine-direct-compiled-int8",
    "after-compiled-w8a8": "engine-direct-compiled-w8a8",
}


def _openmp(result: dict[str, Any]) -> str:
    """How every system's idle OpenMP threads waited (runs before the setting was recorded: PASSIVE)."""
    env = result.get("openmp_env", {"OMP_WAIT_POLICY": "PASSIVE"})
    return ", ".join(f"`{k}={v}`" for k, v in sorted(env.items())) or "libgomp's defaults"


def scenario_view(scenario: dict[str, Any]) -> dict[str, Any]:
    """The figures the tables need, over all streams and over the streams of at least 4 s."""
    s, streams = scenario["summary"], scenario["streams"]
    long = [m for m in streams if (m.get("audio_s") or 0) >= LONG_S - 1e-6]

    def under(ms: list[dict[str, Any]]) -> int:
        return sum(
            1 for m in ms for e in m["listener"] if e["threshold_ms"] == LISTENER_MS and e["underruns"] > 0
        )

    def pct(ms: list[dict[str, Any]], key: str, q: int) -> float | None:
        values = sorted(m[key] for m in ms if m.get(key) is not None)
        if not values:
            return None
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1]

    return {
        "system": scenario["system"],
        "concurrency": scenario["concurrency"],
        "streams": s["streams"],
        "long": len(long),
        "errors": s["error_streams"],
        "throughput": s["throughput"]["steady_audio_s_per_wall_s"],
        "per_cpu": s["throughput"].get("audio_s_per_cpu_s"),
        "rtf_p50": s["rtf"]["p50"],
        "rtf_p90": s["rtf"]["p90"],
        "rtf_long_p50": pct(long, "rtf", 50),
        "rtf_long_p90": pct(long, "rtf", 90),
        "underruns": under(streams),
        "underruns_long": under(long),
        "ttfa_p50": s["ttfa_s"]["p50"],
        "ttfa_p90": s["ttfa_s"]["p90"],
        "load": scenario.get("loadavg_1m_after"),
    }


def views(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """``(system, concurrency)`` → :func:`scenario_view`; a system measured twice keeps its better round."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for scenario in result["scenarios"]:
        if scenario.get("mode") != "closed":
            continue
        view = scenario_view(scenario)
        key = (view["system"], int(view["concurrency"]))
        if key not in out or view["throughput"] > out[key]["throughput"]:
            out[key] = view
    return out


def targets(result: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """Issue #23's targets on this CPU: (what, the numbers, met)."""
    rows: list[tuple[str, str, bool | None]] = []
    step = result.get("step")
    if step:
        rows += step_targets(step)
    v = views(result)
    pairs = interleaved_pairs(result)
    servers = [name for name in SERVER_ENGINE if (name, 1) in v or (name, 8) in v]
    for name in servers:
        c1, c8 = v.get((name, 1)), v.get((name, 8))
        if c1:
            met = c1["long"] > 0 and (c1["rtf_long_p50"] or 99) <= 1.0 and c1["underruns_long"] == 0
            numbers = (
                f"RTF p50 {fmt(c1['rtf_long_p50'], 2)} over {c1['long']} streams ≥ 4 s, "
                f"{c1['underruns_long']} of them under-ran at {LISTENER_MS:g} ms"
            )
            rows.append((f"{name}: c1 real time", numbers, met))
            ttfa = c1["ttfa_p50"]
            rows.append(
                (f"{name}: TTFA p50 at c1 ≤ 0.5 s", f"{fmt(ttfa, 3)} s", ttfa is not None and ttfa <= 0.5)
            )
        if c8:
            rows.append(
                (f"{name}: c8 ≥ 3 audio-s per wall-s", f"{fmt(c8['throughput'], 2)}", c8["throughput"] >= 3)
            )
            engine = v.get((SERVER_ENGINE[name], 8))
            if engine and name not in pairs:
                ratio = c8["throughput"] / engine["throughput"]
                numbers = f"{fmt(c8['throughput'], 2)} / {fmt(engine['throughput'], 2)} = {ratio:.2f}×"
                rows.append((f"{name}: server ≥ 0.95× the engine in-process at c8", numbers, ratio >= 0.95))
    for name, pair in pairs.items():  # part 'ratio' measured it interleaved: its means decide
        numbers = (
            f"{fmt(pair['server_mean'], 2)} / {fmt(pair['engine_mean'], 2)} = {fmt(pair['ratio'], 3)}× "
            f"(means of {pair['rounds']} interleaved rounds; each round {_rounds_text(pair)})"
        )
        what = f"{name}: server ≥ 0.95× the engine in-process at c{pair['concurrency']}"
        rows.append((what, numbers, pair["ratio"] is not None and pair["ratio"] >= 0.95))
    return rows


def interleaved_pairs(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Part 'ratio': each server against its engine in-process, per round and as means.

    Returns server name → ``concurrency``, ``rounds`` (rounds where both sides ran),
    ``per_round`` [(round, server, engine)], ``server_mean``, ``engine_mean`` and ``ratio``
    (the ratio of the means: every round weighs the same on both sides).
    """
    tallies: dict[str, dict[int, dict[str, float]]] = {}
    levels: dict[str, int] = {}
    engines = {engine: server for server, engine in SERVER_ENGINE.items()}
    for scenario in result.get("ratio_scenarios", []):
        system, round_ = scenario["system"], scenario.get("ratio_round")
        if round_ is None or scenario.get("mode") != "closed":
            continue
        server, side = (system, "server") if system in SERVER_ENGINE else (engines.get(system), "engine")
        if server is None:
            continue
        levels[server] = int(scenario["concurrency"])
        throughput = scenario["summary"]["throughput"]["steady_audio_s_per_wall_s"]
        tallies.setdefault(server, {}).setdefault(int(round_), {})[side] = throughput
    pairs: dict[str, dict[str, Any]] = {}
    for server, by_round in tallies.items():
        both = [(r, x["server"], x["engine"]) for r, x in sorted(by_round.items()) if len(x) == 2]
        if not both:
            continue
        server_mean = statistics.fmean(s for _, s, _ in both)
        engine_mean = statistics.fmean(e for _, _, e in both)
        pairs[server] = {
            "concurrency": levels[server],
            "rounds": len(both),
            "per_round": both,
            "server_mean": server_mean,
            "engine_mean": engine_mean,
            "ratio": server_mean / engine_mean if engine_mean > 0 else None,
        }
    return pairs


def _rounds_text(pair: dict[str, Any]) -> str:
    return ", ".join(f"{s:.2f}/{e:.2f}" for _, s, e in pair["per_round"])


def render(result: dict[str, Any]) -> str:
    """The report."""
    m = result["machine"]
    lines = [
        "# The token step and the server on this CPU (issue #23)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cpu_cores')} cores, {m.get('memory_gib')} GiB, "
        f"torch {m.get('versions', {}).get('torch')}; {result['settings']['threads']} torch threads, "
        f"OpenMP waits: {_openmp(result)}. Commits: {result['commits']}. 1-minute load average at start "
        f"{fmt(m.get('loadavg_at_start', [None])[0])}, now {fmt(m.get('loadavg_now', [None])[0])}; "
        f"loads in **bold** (above {LOADED:g} on 2 cores) mark numbers taken on a loaded machine. "
        f"Elapsed {result.get('elapsed_s', 0) / 60:.0f} min.",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for what, numbers, met in targets(result):
        lines.append(f"| {what} | {numbers} | {'—' if met is None else 'yes' if met else '**no**'} |")
    step = result.get("step")
    if step:
        lines += step_tables(step)
    lines += _server_table(result)
    lines += _ratio_table(result)
    if result.get("skipped"):
        lines += ["", "## Not measured", ""] + [f"- {s['what']}: {s['why']}" for s in result["skipped"]]
    return "\n".join(lines) + "\n"


def _server_table(result: dict[str, Any]) -> list[str]:
    v = views(result)
    if not v:
        return []
    lines = [
        "",
        "## End to end: servers and in-process baselines (closed loops, pcm16)",
        "",
        "| system | streams | streams ≥ 4 s | audio-s per wall-s (per CPU-s) | RTF p50 / p90 "
        "| RTF p50 / p90, ≥ 4 s "
        f"| underrun streams @{LISTENER_MS:g} ms (all, ≥ 4 s) | TTFA p50 / p90 (s) | errors | load after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = ["before", *SERVER_ENGINE, "chattts-infer", *SERVER_ENGINE.values()]
    for (system, c), x in sorted(v.items(), key=lambda kv: (_rank(order, kv[0][0]), kv[0][1])):
        lines.append(
            f"| {system} c{c} | {x['streams']} | {x['long']} | "
            f"{fmt(x['throughput'], 2)} ({fmt(x['per_cpu'], 2)}) | "
            f"{fmt(x['rtf_p50'], 2)} / {fmt(x['rtf_p90'], 2)} | {fmt(x['rtf_long_p50'], 2)} / "
            f"{fmt(x['rtf_long_p90'], 2)} | {x['underruns']}, {x['underruns_long']} | "
            f"{fmt(x['ttfa_p50'], 3)} / {fmt(x['ttfa_p90'], 3)} | {x['errors']} | {load_note(x['load'])} |"
        )
    lines += _engine_thread_table(result)
    for name, entries in result.get("systems", {}).items():
        for entry in entries:
            compute = entry.get("hello", {}).get("compute")
            ready = (entry.get("server") or {}).get("ready_s")
            if compute or ready:
                lines.append(
                    f"\n`{name}`: hello.compute {compute}; ready (load, warm-up) after {fmt(ready)} s."
                )
    return lines


def _ratio_table(result: dict[str, Any]) -> list[str]:
    """Part 'ratio': each round of each server and its engine, then the means."""
    pairs = interleaved_pairs(result)
    if not pairs:
        return []
    lines = [
        "",
        "## Server against its engine in-process, interleaved (part 'ratio')",
        "",
        "Server first in even rounds, engine first in odd ones; one server process for every "
        "round, a fresh engine child each round; the same jobs and seeds each time. Audio-s per "
        "wall-s while all streams were in flight.",
        "",
        "| server | round | server | engine in-process | server / engine |",
        "|---|---|---|---|---|",
    ]
    for name, pair in pairs.items():
        level = f"{name} c{pair['concurrency']}"
        for round_, server, engine in pair["per_round"]:
            ratio = server / engine if engine > 0 else None
            lines.append(f"| {level} | {round_} | {server:.2f} | {engine:.2f} | {fmt(ratio, 3)}× |")
        lines.append(
            f"| {level} | **mean** | {pair['server_mean']:.2f} | {pair['engine_mean']:.2f} | "
            f"**{fmt(pair['ratio'], 3)}×** |"
        )
    threads = [s for s in result.get("ratio_scenarios", []) if s.get("engine_thread")]
    if threads:
        lines += _engine_thread_table({"scenarios": threads}, rounds=True)
    return lines


def _engine_thread_table(result: dict[str, Any], rounds: bool = False) -> list[str]:
    """Each scenario's inference thread (``engine_thread_figures``: a server's, or an in-process engine's)."""
    rows = [s for s in result["scenarios"] if s.get("engine_thread")]
    if not rows:
        return []
    lines = [
        "",
        "The inference thread during each scenario (a server's from its `/metrics`, the engine in-process "
        "timed around its steps): the share of the wall time inside engine steps (the rest: prefills, the "
        "policy, waiting for work), tokens per block, rows per step, and the step's wall ms per token "
        "step (a server slower here than its engine in-process loses inside the step, to CPU contention).",
        "",
        "| system | busy | tokens per block | rows per step | step ms per token step |",
        "|---|---|---|---|---|",
    ]
    for s in rows:
        e = s["engine_thread"]
        label = f"{s['system']} c{s['concurrency']}" + (f" round {s.get('ratio_round')}" if rounds else "")
        lines.append(
            f"| {label} | {fmt(e.get('engine_busy'), 2)} | "
            f"{fmt(e.get('tokens_per_block'))} | {fmt(e.get('rows_per_step'), 2)} | "
            f"{fmt(e.get('step_ms_per_token'))} |"
        )
    return lines


def _rank(order: list[str], name: str) -> int:
    return order.index(name) if name in order else len(order)
