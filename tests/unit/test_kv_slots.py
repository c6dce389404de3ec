"""KV slots sized to the device when ``--max-batch`` is 0: the arithmetic, with a fake free-memory figure.

No GPU is needed: ``torch.device("cuda")`` is only a name here, and ``free_memory`` stands in
for ``torch.cuda.mem_get_info``. The policy then takes the engine's slots as its batch limit.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from server.config import load_settings
from server.core.policy import PolicyConfig, SchedulingPolicy
from server.engine.chattts.setup import (
    CPU_MAX_BATCH,
    CUDA_KV_RESERVE_BYTES,
    FreeMemory,
    kv_slot_bytes,
    kv_slots,
    slots_in,
)
from server.engine.flags import engine_options

GiB = 2**30
#: ChatTTS's GPT: 20 layers, 12 heads of 64 (no grouped KV), 4096 positions.
FULL = SimpleNamespace(
    num_hidden_layers=20, num_attention_heads=12, hidden_size=768, max_position_embeddings=4096
)
#: Positions of one slot with the default flags: the longest prompt's bucket + 2048 tokens.
POSITIONS = 3120
CUDA = torch.device("cuda")


def free(nbytes: int, total: int = 80 * GiB) -> FreeMemory:
    def mem_get_info(device: torch.device) -> tuple[int, int]:
        assert device.type == "cuda"
        return nbytes, total

    return mem_get_info


def test_a_full_model_slot_is_60_kib_a_position_in_bf16() -> None:
    assert kv_slot_bytes(FULL, 1, torch.bfloat16) == 2 * 20 * 12 * 64 * 2 == 61_440
    assert kv_slot_bytes(FULL, POSITIONS, torch.bfloat16) == 191_692_800  # 182.8 MiB
    assert kv_slot_bytes(FULL, POSITIONS, torch.float32) == 2 * 191_692_800
    grouped = SimpleNamespace(**{**vars(FULL), "num_key_value_heads": 4})
    assert kv_slot_bytes(grouped, 1, torch.bfloat16) == 2 * 20 * 4 * 64 * 2


def test_slots_fit_the_free_memory_less_the_reserve() -> None:
    slot = kv_slot_bytes(FULL, POSITIONS, torch.bfloat16)
    assert 6 * GiB == CUDA_KV_RESERVE_BYTES
    # An 80 GB H100 after loading: about 78.2 GiB free (context and weights taken).
    assert slots_in(int(78.2 * GiB), slot) == 404
    assert slots_in(6 * GiB + 10 * slot, slot) == 10
    assert slots_in(6 * GiB + 10 * slot - 1, slot) == 9
    assert slots_in(1 * GiB, slot) == 1  # never none: the server still runs, one row at a time


def test_on_cuda_an_unset_max_batch_sizes_the_slots_from_free_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slot = kv_slot_bytes(FULL, POSITIONS, torch.bfloat16)
    caplog.set_level(logging.INFO, logger="server.engine.chattts.setup")
    fake = free(6 * GiB + 300 * slot + 5)
    n = kv_slots(None, FULL, device=CUDA, dtype=torch.bfloat16, max_len=POSITIONS, free_memory=fake)
    assert n == 300
    assert "300 of 182.8 MiB (3120 positions) fit" in caplog.text
    # A --max-batch given is kept, on any device; off CUDA the default is the CPU's 16.
    assert kv_slots(24, FULL, device=CUDA, dtype=torch.bfloat16, max_len=POSITIONS, free_memory=fake) == 24
    cpu = torch.device("cpu")
    assert kv_slots(None, FULL, device=cpu, dtype=torch.bfloat16, max_len=POSITIONS) == CPU_MAX_BATCH == 16


def test_max_batch_0_is_the_default_and_leaves_the_slots_to_the_device() -> None:
    assert load_settings([], env={}).max_batch == 0
    assert engine_options(load_settings([], env={})).max_batch is None
    assert engine_options(load_settings(["--max-batch", "64"], env={})).max_batch == 64
    with pytest.raises(ValueError, match=r"--max-batch -1: must be 0 \(sized to the device\) or more"):
        engine_options(load_settings(["--max-batch", "-1"], env={}))


def test_the_policy_takes_the_engines_slots_when_max_batch_is_0() -> None:
    policy = SchedulingPolicy(PolicyConfig(max_batch=0))
    policy.fit_engine(404)
    assert policy.batch_limit == policy.config.max_batch == 404
    stated = SchedulingPolicy(PolicyConfig(max_batch=0))
    stated.fit_engine(None)  # an engine with no limit of its own (the fake one)
    assert stated.batch_limit == 16
    given = SchedulingPolicy(PolicyConfig(max_batch=24))
    given.fit_engine(404)  # a --max-batch given is kept
    assert given.batch_limit == 24
