"""``--profile``: the default on a CPU is the compiled w8a8 step, CUDA keeps its defaults, and a
step flag given explicitly wins over the profile (and is named in the start-up line)."""

from __future__ import annotations

import pytest

from server.config import PROFILE_CHOICES, Settings, load_settings
from server.engine.flags import engine_options
from server.engine.profiles import apply_profile, profile_values


def _step(settings: Settings) -> tuple[str, str, str]:
    return settings.compile_step, settings.quantize, settings.dtype


def test_the_default_profile_on_a_cpu_is_realtime_the_compiled_w8a8_step() -> None:
    settings = load_settings([], env={})
    assert settings.profile == "realtime" == PROFILE_CHOICES[0]
    applied = apply_profile(settings, "cpu", w8a8_available=True)
    assert _step(applied.settings) == ("ahead", "w8a8", "auto")  # auto: bf16 where the CPU has it natively
    options = engine_options(applied.settings)
    assert options.compile_step is True and options.compile_ahead is True and options.quantize == "w8a8"
    line = applied.log_line()
    assert line.startswith("profile realtime on cpu: set --compile-step ahead, --quantize w8a8")
    assert "kept as given" not in line


def test_realtime_without_fbgemm_compiles_the_step_unquantized() -> None:
    """w8a8 needs FBGEMM (x86-64): elsewhere realtime is the compiled bf16/float32 step."""
    applied = apply_profile(load_settings([], env={}), "cpu", w8a8_available=False)
    assert _step(applied.settings) == ("on", "none", "auto")


def test_on_cuda_every_profile_but_exact_keeps_the_cuda_defaults() -> None:
    """CUDA graphs in fp16/bf16: nothing compiled by inductor, nothing quantized."""
    for profile in ("realtime", "eager"):
        settings = load_settings(["--profile", profile], env={})
        applied = apply_profile(settings, "cuda", w8a8_available=False)
        assert _step(applied.settings) == ("off", "none", "auto")
        assert applied.settings.cuda_graphs == "on"
    exact = apply_profile(load_settings(["--profile", "exact"], env={}), "cuda", w8a8_available=False)
    assert _step(exact.settings) == ("off", "none", "float32") and exact.settings.cuda_graphs == "on"


def test_eager_and_exact_compile_nothing_and_exact_is_float32() -> None:
    eager = apply_profile(load_settings([], env={"CHATTTS_PROFILE": "eager"}), "cpu", w8a8_available=True)
    assert _step(eager.settings) == ("off", "none", "auto")
    exact = apply_profile(load_settings(["--profile", "exact"], env={}), "cpu", w8a8_available=True)
    assert _step(exact.settings) == ("off", "none", "float32")
    assert "set --compile-step off, --quantize none, --dtype float32" in exact.log_line()


@pytest.mark.parametrize(
    ("flags", "expected", "kept"),
    [
        (["--compile-step", "off"], ("off", "w8a8", "auto"), "--compile-step off"),
        (["--compile-step", "on"], ("on", "w8a8", "auto"), "--compile-step on"),
        # the unfrozen graphs a restart loads are as fast as frozen ones for w8a8 only
        (["--quantize", "none"], ("on", "none", "auto"), "--quantize none"),
        (["--quantize", "int8"], ("on", "int8", "auto"), "--quantize int8"),
        (["--dtype", "float32"], ("ahead", "w8a8", "float32"), "--dtype float32"),
    ],
)
def test_a_step_flag_given_explicitly_wins_over_the_profile(
    flags: list[str], expected: tuple[str, str, str], kept: str
) -> None:
    applied = apply_profile(load_settings(flags, env={}), "cpu", w8a8_available=True)
    assert _step(applied.settings) == expected
    if flags[0] != "--dtype":  # realtime leaves --dtype to its own auto rule: nothing to keep
        assert applied.log_line().endswith(f"kept as given: {kept}")
    # ... and the same value from its variable
    name = "CHATTTS_" + flags[0].removeprefix("--").replace("-", "_").upper()
    from_env = apply_profile(load_settings([], env={name: flags[1]}), "cpu", w8a8_available=True)
    assert _step(from_env.settings) == expected


def test_exact_under_an_explicit_dtype_says_the_dtype_was_kept() -> None:
    applied = apply_profile(
        load_settings(["--profile", "exact", "--dtype", "bfloat16"], env={}), "cpu", w8a8_available=True
    )
    assert _step(applied.settings) == ("off", "none", "bfloat16")
    assert applied.log_line().endswith("kept as given: --dtype bfloat16")


def test_an_unknown_profile_is_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        load_settings(["--profile", "throughput"], env={})
    with pytest.raises(ValueError, match="--profile 'fast'"):
        profile_values("fast", "cpu", w8a8_available=True)


def test_an_unresolved_auto_counts_as_the_eager_step_when_flags_are_checked() -> None:
    """The loader checks every engine flag before the device is known: ``auto`` is off there."""
    options = engine_options(load_settings([], env={}))
    assert options.compile_step is False and options.quantize == "none"
