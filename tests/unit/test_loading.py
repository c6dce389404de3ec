"""Engine settings are checked before any weight is loaded, with one actionable line."""

from __future__ import annotations

import pytest

from server.config import load_settings
from server.engine.loading import ModelUnavailable, chattts_engine_factory, parse_block_schedule


def test_block_schedule_parses_and_rejects_nonsense() -> None:
    assert parse_block_schedule("8,16,32") == (8, 16, 32)
    assert parse_block_schedule("4") == (4,)
    for bad in ("", "8,x", "8,0", "-1"):
        with pytest.raises(ModelUnavailable, match="--block-schedule"):
            parse_block_schedule(bad)


def test_prefill_bucket_below_one_is_refused_by_name() -> None:
    settings = load_settings(["--prefill-bucket", "0"], env={})
    with pytest.raises(ModelUnavailable, match="--prefill-bucket 0"):
        chattts_engine_factory(settings)
    assert load_settings([], env={"CHATTTS_PREFILL_BUCKET": "32"}).prefill_bucket == 32
    assert callable(chattts_engine_factory(load_settings(["--prefill-bucket", "1"], env={})))
