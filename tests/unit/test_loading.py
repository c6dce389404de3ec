"""Engine settings are checked before any weight is loaded, with one actionable line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.config import DEFAULT_OMP_SPIN_COUNT, load_settings
from server.engine.flags import parse_block_schedule, thread_environment
from server.engine.loading import ModelUnavailable, chattts_engine_factory


def test_block_schedule_parses_and_rejects_nonsense() -> None:
    assert parse_block_schedule("8,16,32") == (8, 16, 32)
    assert parse_block_schedule("4") == (4,)
    for bad in ("", "8,x", "8,0", "-1"):
        with pytest.raises(ValueError, match="--block-schedule"):
            parse_block_schedule(bad)
        with pytest.raises(ModelUnavailable, match="--block-schedule"):
            chattts_engine_factory(load_settings(["--block-schedule", bad], env={}))


def test_prefill_bucket_below_one_is_refused_by_name() -> None:
    settings = load_settings(["--prefill-bucket", "0"], env={})
    with pytest.raises(ModelUnavailable, match="--prefill-bucket 0"):
        chattts_engine_factory(settings)
    assert load_settings([], env={"CHATTTS_PREFILL_BUCKET": "32"}).prefill_bucket == 32
    assert callable(chattts_engine_factory(load_settings(["--prefill-bucket", "1"], env={})))


@pytest.mark.parametrize(("flag", "value"), [("--segment-max-tokens", "0"), ("--max-batch", "-1")])
def test_kv_cache_sizes_below_one_are_refused_by_name(flag: str, value: str) -> None:
    # --max-batch 0 is valid: the slots are sized to the device (tests/unit/test_kv_slots.py).
    with pytest.raises(ModelUnavailable, match=f"{flag} {value}"):
        chattts_engine_factory(load_settings([flag, value], env={}))


def test_cuda_graphs_flag_and_variable() -> None:
    assert load_settings([], env={}).cuda_graphs == "on"
    assert load_settings([], env={"CHATTTS_CUDA_GRAPHS": "off"}).cuda_graphs == "off"
    assert load_settings(["--cuda-graphs", "off"], env={"CHATTTS_CUDA_GRAPHS": "on"}).cuda_graphs == "off"
    with pytest.raises(SystemExit):
        load_settings(["--cuda-graphs", "maybe"], env={})
    assert load_settings([], env={"CHATTTS_SEGMENT_MAX_TOKENS": "900"}).segment_max_tokens == 900
    assert load_settings([], env={}).compile_step == "auto"  # --profile decides (tests/unit/test_profiles.py)
    assert load_settings([], env={"CHATTTS_COMPILE_STEP": "on"}).compile_step == "on"
    with pytest.raises(SystemExit):
        load_settings(["--compile-step", "yes"], env={})


def test_openmp_threads_spin_briefly_unless_told_otherwise() -> None:
    def wanted(flags: list[str], env: dict[str, str]) -> dict[str, str]:
        return thread_environment(load_settings(flags, env={}), env)

    assert wanted([], {}) == {"GOMP_SPINCOUNT": str(DEFAULT_OMP_SPIN_COUNT)}
    assert wanted(["--omp-spin-count", "3000"], {}) == {"GOMP_SPINCOUNT": "3000"}
    assert wanted([], {"OMP_WAIT_POLICY": "ACTIVE"}) == {}  # the operator's own setting stays
    assert wanted([], {"GOMP_SPINCOUNT": "50"}) == {}
    assert wanted(["--omp-wait-policy", "active"], {}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    # libgomp lets GOMP_SPINCOUNT override PASSIVE, so passive zeroes it.
    assert wanted(["--omp-wait-policy", "passive"], {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "9"}) == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": "0",
    }
    assert load_settings([], env={"CHATTTS_OMP_WAIT_POLICY": "active"}).omp_wait_policy == "active"
    assert load_settings([], env={"CHATTTS_OMP_SPIN_COUNT": "7"}).omp_spin_count == 7
    with pytest.raises(ModelUnavailable, match="--omp-spin-count -1"):
        chattts_engine_factory(load_settings(["--omp-spin-count", "-1"], env={}))


def test_an_inherited_wait_policy_that_sleeps_is_logged_with_its_cost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue #46: OMP_WAIT_POLICY=PASSIVE in the environment took one stream from RTF 1.3 to 2.5, silently."""
    from server.engine.flags import inherited_wait_policy
    from server.engine.loading import prepare_threads

    auto, active = load_settings([], env={}), load_settings(["--omp-wait-policy", "active"], env={})
    costly = inherited_wait_policy(auto, {"OMP_WAIT_POLICY": "passive"})
    assert (
        costly is not None and costly[0] and "--omp-wait-policy active" in costly[1] and "1.8x" in costly[1]
    )
    assert inherited_wait_policy(auto, {"GOMP_SPINCOUNT": "0"}) == (
        True,
        costly[1].replace("OMP_WAIT_POLICY=passive", "GOMP_SPINCOUNT=0"),
    )
    kept = inherited_wait_policy(auto, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"})
    assert kept is not None and not kept[0]  # libgomp spins first: the server's own kind of wait
    assert inherited_wait_policy(auto, {}) is None
    assert inherited_wait_policy(active, {"OMP_WAIT_POLICY": "PASSIVE"}) is None  # the flag overrides it
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.INFO, "server.engine.loading"):
        patch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        patch.delenv("GOMP_SPINCOUNT", raising=False)
        prepare_threads(auto)
    (record,) = [r for r in caplog.records if "OpenMP" in r.getMessage()]
    assert record.levelno == logging.WARNING and "OMP_WAIT_POLICY=PASSIVE" in record.getMessage()


def test_the_wait_policy_is_in_the_environment_before_torch_loads(tmp_path: Path) -> None:
    """A fresh interpreter builds the engine as the server does (the weights are missing, so it fails)."""
    code = (
        "import os, sys; from server.config import load_settings; "
        "from server.engine.loading import ModelUnavailable, chattts_engine_factory; "
        f"build = chattts_engine_factory(load_settings(['--model-dir', {str(tmp_path)!r}], env={{}})); "
        "assert 'torch' not in sys.modules\n"
        "try: build()\n"
        "except ModelUnavailable: pass\n"
        "assert 'torch' in sys.modules; print(os.environ.get('GOMP_SPINCOUNT'))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    root = Path(__file__).resolve().parents[2]
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, cwd=root, env=env, capture_output=True, text=True, timeout=250, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(DEFAULT_OMP_SPIN_COUNT)


def test_engine_cpus_parse_and_refuse_by_name() -> None:
    from server.engine.flags import parse_cpus

    four = frozenset(range(4))
    assert parse_cpus("", four) == frozenset()
    assert parse_cpus("1", four) == {1}
    assert parse_cpus("0,2-3", four) == {0, 2, 3}
    for bad, why in (
        ("x", "expected CPU numbers"),
        ("7", "CPUs 0,1,2,3 only"),
        ("0-3", "leave at least one"),
    ):
        with pytest.raises(ValueError, match=f"--engine-cpus.*{why}"):
            parse_cpus(bad, four)
        with pytest.raises(ModelUnavailable, match="--engine-cpus"):
            chattts_engine_factory(load_settings(["--engine-cpus", bad], env={}))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="2 CPUs")
def test_engine_cpus_pin_the_inference_thread_and_keep_the_loop_off_them(tmp_path: Path) -> None:
    """A fresh interpreter: the factory pins the calling thread to the others, build() its own thread."""
    code = (
        "import os, threading; from server.config import load_settings; "
        "from server.engine.loading import ModelUnavailable, chattts_engine_factory; "
        "first = min(os.sched_getaffinity(0)); "
        f"flags = ['--engine-cpus', str(first), '--model-dir', {str(tmp_path)!r}]; "
        "settings = load_settings(flags, env={}); "
        "build = chattts_engine_factory(settings); seen = {}\n"
        "def inference():\n"
        "    try: build()\n"
        "    except ModelUnavailable: seen['engine'] = os.sched_getaffinity(0)\n"
        "thread = threading.Thread(target=inference); thread.start(); thread.join()\n"
        "print(first, sorted(seen['engine']), first in os.sched_getaffinity(0))"
    )
    root = Path(__file__).resolve().parents[2]
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, cwd=root, capture_output=True, text=True, timeout=250, check=False)
    assert out.returncode == 0, out.stderr
    first = out.stdout.split()[0]  # the engine's CPU; the inference thread had only it, the loop not it
    assert out.stdout.strip() == f"{first} [{first}] False"
