from __future__ import annotations

import pytest

from server.cli import main
from server.config import load_settings


def test_flag_beats_environment_beats_default() -> None:
    assert load_settings([], env={}).max_batch == 0  # sized to the device (tests/unit/test_kv_slots.py)
    assert load_settings([], env={"CHATTTS_MAX_BATCH": "4"}).max_batch == 4
    assert load_settings(["--max-batch", "2"], env={"CHATTTS_MAX_BATCH": "4"}).max_batch == 2


def test_booleans_and_choices_from_environment() -> None:
    assert load_settings([], env={"CHATTTS_WARMUP": "false"}).warmup is False
    assert load_settings(["--no-warmup"], env={}).warmup is False
    assert load_settings([], env={"CHATTTS_ENGINE": "fake"}).engine == "fake"
    with pytest.raises(SystemExit):
        load_settings(["--engine", "other"], env={})
    with pytest.raises(SystemExit):
        load_settings([], env={"CHATTTS_PORT": "eighty"})


def test_help_documents_every_flag_with_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag, env in [
        ("--max-batch", "CHATTTS_MAX_BATCH"),
        ("--engine", "CHATTTS_ENGINE"),
        ("--drain-timeout-s", "CHATTTS_DRAIN_TIMEOUT_S"),
        ("--dev-model", "CHATTTS_DEV_MODEL"),
    ]:
        assert flag in out and env in out


def test_verify_weights_defaults_to_official_and_takes_its_variable() -> None:
    assert load_settings([], env={}).verify_weights == "official"
    assert load_settings([], env={"CHATTTS_VERIFY_WEIGHTS": "none"}).verify_weights == "none"
    assert load_settings(
        ["--verify-weights", "official"], env={"CHATTTS_VERIFY_WEIGHTS": "none"}
    ).verify_weights == ("official")
    with pytest.raises(SystemExit):
        load_settings(["--verify-weights", "sometimes"], env={})


def test_dtype_auto_on_the_cpu_is_bf16_only_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("ChatTTS")
    from server.engine.chattts import setup as chattts_setup
    from server.engine.chattts.engine import resolve_dtype

    cpu = torch.device("cpu")
    monkeypatch.setattr(chattts_setup, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(chattts_setup, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", cpu)
