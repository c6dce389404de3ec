"""``python -m bench.gpu_sim``: the real engine core and policy on a simulated H100 (issue #43).

Small configurations, seconds each: the command's report, and the two properties the
model's verdict rests on: the virtual clock charges the host's real CPU time, and no quantum
is cut short (every live row makes K tokens per quantum, one host read per quantum).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu_sim.clock import VirtualClock
from bench.gpu_sim.engine import QuantumEngine
from bench.gpu_sim.level import SimSettings, run_level
from bench.gpu_sim.model import CostModel
from bench.harness.textset import DEFAULT_TEXTS, load_texts
from server.core.policy import PolicyConfig
from server.engine_api import SequenceRequest, SynthesisParams
from tests.bench.runner import run_ok

TEXTS = load_texts(DEFAULT_TEXTS)


def _settings(**changes: float) -> SimSettings:
    base = {"host_scale": 1.0, "duration_s": 6.0}
    base.update(changes)
    return SimSettings(
        model=CostModel(), policy=PolicyConfig(max_batch=64), slots=64, quantum=4, seed=7, **base
    )


def test_the_command_writes_its_report_on_a_small_configuration(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    argv = ["--levels", "8,16", "--duration-s", "6", "--bisect-max", "32", "--out", str(out)]
    proc = run_ok("bench.gpu_sim", *argv, timeout=300)
    results = json.loads(out.with_suffix(".json").read_text())
    assert [(lv["streams"], lv["arrival"]) for lv in results["levels"]] == [
        (8, "burst"),
        (8, "poisson"),
        (16, "burst"),
        (16, "poisson"),
    ]
    for level in results["levels"]:
        assert level["requests"] > 0 and level["failed"] == 0 and not level["cut"]
        assert level["ttfa_ms"]["p50"] > 0 and level["ttfa_ms"]["p99"] >= level["ttfa_ms"]["p50"]
        assert set(level["listeners"]) == {"300", "100"}
        assert level["quanta_per_s"] > 0 and level["rows_per_quantum"] >= 1
        assert set(level["device_ms_per_quantum"]) == {"step", "decode", "prefill"}
        assert level["host_ms_per_quantum"] > 0 and level["passed"] in (True, False)
    assert results["model"]["step_base_s"] == CostModel().step_base_s  # the constants are in the file
    assert results["design"]["quantum_tokens"] == 4 and results["design"]["overlap"] is True
    search = results["search"]
    assert search["most_streams"] >= 16 and search["probes"]
    assert [w["change"].split(" (")[0] for w in search["what_if"]] == [
        "look-ahead off",
        "batch places unbounded",
        "overlap off",
        "a first block of 4 tokens",
    ]
    report = out.with_suffix(".md").read_text()
    for heading in ("## Cost model", "## Levels", "## The most streams the model predicts", "## Notes"):
        assert heading in report
    assert "A model, not a measurement" in report and "| `step_position_s` | 2.6e-08 |" in report
    assert "[gpu_sim] burst 16:" in proc.stdout


def test_the_virtual_clock_charges_the_hosts_cpu_time() -> None:
    """Host work is on the clock: scaled up 400×, it sets the quanta's pace instead of the device."""
    plain = run_level(16, "burst", TEXTS, _settings())
    slow = run_level(16, "burst", TEXTS, _settings(host_scale=400.0))
    assert plain["host_s"] > 0
    assert slow["host_ms_per_quantum"] > 50 * plain["host_ms_per_quantum"]
    # With overlap a quantum takes the longer of the host's and the device's time.
    period_ms = slow["virtual_s"] / slow["quanta"] * 1000
    assert period_ms >= 0.95 * slow["host_ms_per_quantum"]
    assert slow["quanta_per_s"] < plain["quanta_per_s"]
    assert slow["ttfa_ms"]["p50"] > plain["ttfa_ms"]["p50"]


def test_no_quantum_is_cut_short_while_commands_keep_arriving() -> None:
    """Poisson arrivals bring adds during every quantum; each live row still makes K tokens a quantum."""
    level = run_level(32, "poisson", TEXTS, _settings(duration_s=8.0))
    assert level["requests"] > 10 and level["prefills"] > 5
    assert level["short_rows"] == 0
    assert 0.95 <= level["host_reads_per_quantum"] <= 1.0
    assert level["tokens_per_row_quantum"] > 3.9  # rows end mid-quantum only at their last token


def test_overlap_reads_quantum_n_after_launching_quantum_n_plus_1() -> None:
    clock = VirtualClock()
    engine = QuantumEngine(clock, CostModel(), quantum=4, overlap=True, slots=4)
    params = SynthesisParams(seed=1)
    engine.add(SequenceRequest(seq_id=0, text="Hello there, a short one.", params=params))
    assert engine.step([0]) == []  # quantum 0 launched, nothing to read yet
    first_end = engine.log.busy_until_s
    [result] = engine.step([0])  # quantum 1 launched, quantum 0 read
    assert result.tokens == 4 and not result.finished
    assert clock.now() >= first_end  # the host waited for quantum 0 only
    assert engine.log.busy_until_s > clock.now()  # quantum 1 still runs on the device
    assert engine.log.host_reads == 1 and engine.log.quanta == 2


def test_look_ahead_rows_give_their_places_to_newcomers_when_the_places_are_full() -> None:
    """16 places for 96 Poisson listeners: look-ahead rows yield; every stream still completes."""
    tight = SimSettings(
        model=CostModel(),
        policy=PolicyConfig(max_batch=16),
        slots=16,
        quantum=4,
        seed=7,
        host_scale=1.0,
        duration_s=12.0,  # long enough for streams to build the 1 s lead a look-ahead needs
    )
    level = run_level(96, "poisson", TEXTS, tight)
    assert level["peak_slots"] == 16 and level["failed"] == 0 and not level["cut"]
    assert level["yielded_rows"] > 0  # without the rule: 0 (nothing else drops a live row here)
    assert 0 < level["yielded_token_share"] < 0.5
