"""The engine's options: one frozen object with the engine's defaults, checked when built, from the flags."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from server.config import load_settings
from server.engine.chattts.options import EngineOptions
from server.engine.flags import engine_options
from server.voices.recording import transcript_limit


def test_defaults_are_the_engines() -> None:
    options = EngineOptions()
    assert options.block_schedule == (8, 16, 20, 20, 24, 24, 28, 32)
    assert options.default_voice == "seed:2"
    assert (options.context_tokens, options.holdback_tokens, options.crossfade_samples) == (16, 4, 256)
    assert options.min_tokens == 1
    assert options.repetition_penalty == 1.05
    assert options.prefill_bucket == 16
    assert options.warmup_prompt_chars == 120
    assert options.max_batch == 16
    assert options.segment_max_tokens == 2048
    assert options.cuda_graphs is True
    assert options.compile_step is False  # opt-in: minutes of start-up
    assert options.vocoder_dtype == "auto"  # bf16 with a bf16 GPT, else float32
    assert options.refine_max_tokens == 384
    assert options.voice_max_seconds == 10.0
    assert options.voice_transcript_tokens is None
    assert options.quantum_tokens is None  # the device's: 4 on CUDA, 1 on the CPU
    assert (options.quantum_for("cuda"), options.quantum_for("cpu")) == (4, 1)
    assert options.overlap_quanta is None  # the device's: on on CUDA, off on the CPU
    assert (options.overlap_for("cuda"), options.overlap_for("cpu")) == (True, False)
    assert options.transcript_tokens == 200  # 20 tokens a second of the longest recording


def test_transcript_tokens_follow_the_recording_length_unless_given() -> None:
    assert EngineOptions(voice_max_seconds=2.5).transcript_tokens == 50
    assert EngineOptions(voice_max_seconds=0.01).transcript_tokens == math.ceil(20 * 0.01)
    assert EngineOptions(voice_max_seconds=0.0).transcript_tokens == 0
    assert EngineOptions(voice_max_seconds=2.5, voice_transcript_tokens=7).transcript_tokens == 7


def test_the_object_is_frozen_and_hashable() -> None:
    options = EngineOptions(max_batch=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_batch = 8  # type: ignore[misc]
    assert hash(options) == hash(EngineOptions(max_batch=4))
    assert dataclasses.replace(options, max_batch=8).max_batch == 8
    with pytest.raises(TypeError):
        EngineOptions(16)  # type: ignore[misc]  # keywords only


def test_block_schedule_is_kept_as_a_tuple_of_ints() -> None:
    listed = EngineOptions(block_schedule=[4, 8])  # type: ignore[arg-type]
    assert listed.block_schedule == (4, 8)
    assert listed == EngineOptions(block_schedule=(4, 8))
    hash(listed)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"block_schedule": ()}, r"block_schedule \(\): needs at least one block"),
        ({"block_schedule": (8, 0)}, r"block_schedule \(8, 0\): .*each at least 1 token"),
        ({"block_schedule": (-1,)}, r"block_schedule \(-1,\)"),
        ({"prefill_bucket": 0}, r"prefill_bucket 0: must be at least 1 \(1: no padding\)"),
        ({"max_batch": 0}, r"max_batch 0: must be at least 1"),
        ({"segment_max_tokens": 0}, r"segment_max_tokens 0: must be at least 1"),
        ({"quantum_tokens": 0}, r"quantum_tokens 0: must be at least 1 and divide every block"),
        ({"quantum_tokens": 3}, r"quantum_tokens 3: .*divide every block of block_schedule 8,16,20"),
        ({"vocoder_dtype": "float16"}, r"vocoder_dtype 'float16': must be one of auto, float32, bfloat16"),
    ],
)
def test_values_the_engine_cannot_run_with_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineOptions(**values)  # type: ignore[arg-type]


def test_values_the_engine_clamps_are_accepted() -> None:
    # The engine reads min_tokens below 1 as 1 and a negative refinement cap as off, as it always has.
    assert EngineOptions(min_tokens=0).min_tokens == 0
    assert EngineOptions(refine_max_tokens=-1).refine_max_tokens == -1
    assert EngineOptions(prefill_bucket=1).prefill_bucket == 1


def test_the_quantum_divides_every_block() -> None:
    """Blocks are whole quanta, so the decode windows stay where the schedule puts them."""
    assert EngineOptions(quantum_tokens=2).quantum_for("cpu") == 2  # given: on every device
    assert EngineOptions(block_schedule=(8, 16), quantum_tokens=8).quantum_for("cuda") == 8
    # CUDA's default is the largest of 4, 2, 1 that divides the schedule
    assert EngineOptions(block_schedule=(6, 10)).quantum_for("cuda") == 2
    assert EngineOptions(block_schedule=(8, 9)).quantum_for("cuda") == 1


def test_engine_options_maps_the_flags() -> None:
    flags = ["--block-schedule", "4,8", "--prefill-bucket", "32", "--segment-max-chars", "80"]
    flags += ["--max-batch", "3", "--segment-max-tokens", "900", "--cuda-graphs", "off"]
    flags += ["--refine-max-tokens", "0", "--voice-max-seconds", "5", "--compile-step", "on"]
    flags += ["--vocoder-dtype", "float32", "--quantum-tokens", "2", "--cache-dir", "/var/cache/tts"]
    assert engine_options(load_settings(flags, env={})) == EngineOptions(
        block_schedule=(4, 8),
        quantum_tokens=2,
        prefill_bucket=32,
        warmup_prompt_chars=80,
        max_batch=3,
        segment_max_tokens=900,
        cuda_graphs=False,
        compile_step=True,
        compile_cache_dir="/var/cache/tts/compiled",  # beside the weights, in --cache-dir
        vocoder_dtype="float32",
        refine_max_tokens=0,
        voice_max_seconds=5.0,
        voice_transcript_tokens=transcript_limit(5.0),
    )
    assert engine_options(load_settings([], env={"CHATTTS_MAX_BATCH": "2"})).max_batch == 2


@pytest.mark.parametrize(
    ("flag", "compiled", "ahead"), [("on", True, False), ("ahead", True, True), ("off", False, False)]
)
def test_compile_step_ahead_compiles_the_step_ahead_of_time(flag: str, compiled: bool, ahead: bool) -> None:
    options = engine_options(load_settings(["--compile-step", flag], env={}))
    assert (options.compile_step, options.compile_ahead) == (compiled, ahead)


@pytest.mark.parametrize(("flag", "overlap"), [("auto", None), ("on", True), ("off", False)])
def test_overlap_quanta_maps_to_the_option(flag: str, overlap: bool | None) -> None:
    options = engine_options(load_settings(["--overlap-quanta", flag], env={}))
    assert options.overlap_quanta is overlap
    assert options.overlap_for("cpu") is (overlap is True)
    assert options.overlap_for("cuda") is (overlap is not False)


def test_the_flags_defaults_are_the_engines() -> None:
    options = engine_options(load_settings([], env={}))
    # --max-batch 0 (the default) leaves the slots to the device: 16 on the CPU, the engine's default.
    transcript = transcript_limit(10.0)
    expected = dataclasses.replace(EngineOptions(), max_batch=None, voice_transcript_tokens=transcript)
    # The server always keeps a compiled step in its cache dir (the engine alone: inductor's default).
    assert options == dataclasses.replace(expected, compile_cache_dir=options.compile_cache_dir)
    assert options.compile_cache_dir == str(Path.home() / ".cache" / "chattts-stream" / "compiled")
    assert options.transcript_tokens == EngineOptions().transcript_tokens


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-schedule", "8,x"], "--block-schedule '8,x': expected integers such as 8,16,32"),
        (["--block-schedule", "8,0"], "--block-schedule '8,0': every block must be at least 1 token"),
        (["--prefill-bucket", "0"], "--prefill-bucket 0: must be at least 1 (1: off)"),
        (["--segment-max-tokens", "0"], "--segment-max-tokens 0: must be at least 1"),
        (["--max-batch", "-1"], "--max-batch -1: must be 0 (sized to the device) or more"),
        (["--refine-max-tokens", "-1"], "--refine-max-tokens -1: must be 0 (off) or more"),
        (
            ["--quantum-tokens", "3"],
            "--quantum-tokens 3: must be 0 (the device's default) or divide every block of "
            "--block-schedule 8,16,20,20,24,24,28,32",
        ),
        (
            ["--quantum-tokens", "-1"],
            "--quantum-tokens -1: must be 0 (the device's default) or divide every block of "
            "--block-schedule 8,16,20,20,24,24,28,32",
        ),
    ],
)
def test_engine_options_refuses_a_flag_by_its_name(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        engine_options(load_settings(flags, env={}))
    assert str(info.value) == message


def test_options_and_settings_import_no_torch() -> None:
    code = (
        "import sys, server.config, server.engine.chattts.options; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _arrivals(schedule: tuple[int, ...], token_s: float, blocks: int) -> list[tuple[float, float]]:
    """(arrival s, audio s) of a row's first blocks when a token takes ``token_s`` and a decode 5 ms.

    The first block's audio is 5 tokens short (4 held back for the decode's right edge, and the
    window's centring), which the next block brings: as the engine streams it.
    """
    token_audio, now, out = 512 / 24_000, 0.0, []
    for k in range(blocks):
        tokens = schedule[min(k, len(schedule) - 1)]
        now += tokens * token_s + 0.005
        out.append((now, (tokens - 5 if k == 0 else tokens + (5 if k == 1 else 0)) * token_audio))
    return out


@pytest.mark.parametrize("token_ms", [15.0, 17.0, 19.0])
def test_the_default_ramp_keeps_a_300_ms_listener_fed_at_a_step_just_under_real_time(token_ms: float) -> None:
    from bench.harness.listener import simulate

    blocks = 12
    default = simulate(_arrivals(EngineOptions().block_schedule, token_ms / 1000, blocks), 0.3)
    assert default.underruns == 0
    if token_ms >= 18:  # the steeper ramp before it starves the listener at its 32-token block
        assert simulate(_arrivals((8, 16, 20, 24, 32), token_ms / 1000, blocks), 0.3).underruns > 0
