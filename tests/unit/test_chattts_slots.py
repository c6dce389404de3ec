"""KV slots and shape buckets of the ChatTTS engine (no model weights needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from server.engine.chattts.step.kv import SlotKV, batch_buckets, bucket_for, length_buckets  # noqa: E402


def test_batch_buckets_are_powers_of_two_then_the_limit() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_length_buckets_double_then_step_and_end_at_the_slot_length() -> None:
    assert length_buckets(2200, 256) == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2200)
    assert length_buckets(300, 64) == (16, 32, 64, 128, 192, 256, 300)
    assert length_buckets(100, 256) == (16, 32, 64, 100)
    assert length_buckets(256, 128) == (16, 32, 64, 128, 256)
    assert length_buckets(10, 64) == (10,)


def test_bucket_for_picks_the_smallest_that_holds() -> None:
    buckets = (1, 2, 4, 8)
    assert [bucket_for(buckets, n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError):
        bucket_for(buckets, 9)


def _kv(slots: int = 4, max_len: int = 10) -> SlotKV:
    sizes = {"layers": 2, "slots": slots, "kv_heads": 2, "max_len": max_len, "head_dim": 3}
    return SlotKV(**sizes, dtype=torch.float32, device=torch.device("cpu"))


def test_slots_are_handed_out_lowest_first_and_sized_up_front() -> None:
    kv = _kv()
    assert kv.nbytes == 2 * 2 * 4 * 2 * 10 * 3 * 4  # K and V · layers · slots · heads · len · dim · fp32
    assert [kv.take() for _ in range(3)] == [0, 1, 2]
    kv.give_back(1)
    assert kv.take() == 1
    assert kv.take() == 3
    with pytest.raises(IndexError):
        kv.take()
    with pytest.raises(ValueError):
        kv.give_back(7)
    kv.give_back(2)
    with pytest.raises(ValueError):
        kv.give_back(2)  # twice
    assert kv.free_slots == 1


def test_step_cache_writes_each_row_at_its_own_position_only() -> None:
    kv = _kv()
    before = [t.clone() for t in (*kv.keys, *kv.values)]
    rows, positions = torch.arange(2), torch.tensor([3, 7])
    new = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 1, 3) + 1
    keys, values = kv.step_view(rows, positions, 8).update(new, -new, layer_idx=1)
    assert keys.shape == (2, 2, 8, 3) and values.shape == (2, 2, 8, 3)
    assert torch.equal(kv.keys[1][0, :, 3], new[0, :, 0]) and torch.equal(kv.keys[1][1, :, 7], new[1, :, 0])
    assert torch.equal(kv.values[1][1, :, 7], -new[1, :, 0])
    changed = kv.keys[1].ne(0).any(dim=(1, 3)).nonzero().tolist()
    assert changed == [[0, 3], [1, 7]]
    assert torch.equal(before[0], kv.keys[0]) and torch.equal(before[2], kv.values[0])  # layer 0 untouched


def test_prefill_cache_fills_one_slot_from_position_zero() -> None:
    kv = _kv()
    states = torch.randn(1, 2, 5, 3)
    keys, _ = kv.prefill_view(2, 5).update(states, states, layer_idx=0)
    assert keys.shape == (1, 2, 5, 3)
    assert torch.equal(kv.keys[0][2, :, :5], states[0])
    assert kv.keys[0][[0, 1, 3]].abs().sum() == 0 and kv.keys[0][2, :, 5:].abs().sum() == 0
