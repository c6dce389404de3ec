"""KV slots and shape buckets of the ChatTTS engine (no model weights needed)."""

from __future__ import annotations

import contextlib
import ctypes
import os

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


def test_prefill_cache_fills_each_rows_slot_from_position_zero() -> None:
    kv = _kv()
    states = torch.randn(2, 2, 5, 3)
    keys, _ = kv.prefill_view(torch.tensor([2, 0]), 5).update(states, states, layer_idx=0)
    assert keys.shape == (2, 2, 5, 3)
    assert torch.equal(kv.keys[0][2, :, :5], states[0]) and torch.equal(kv.keys[0][0, :, :5], states[1])
    assert kv.keys[0][[1, 3]].abs().sum() == 0 and kv.keys[0][[0, 2], :, 5:].abs().sum() == 0


# --- resident memory on the CPU: pages follow the positions written ------------------------------

MiB = 2**20
#: 256 MiB of address space: 2 layers · K and V · 4 slots · 8 heads · 8192 positions · 64 · fp32.
#: One position of one slot (every layer, K and V, every head) is 8 KiB, one head's run of it 256 B.
BIG = {"layers": 2, "slots": 4, "kv_heads": 8, "max_len": 8192, "head_dim": 64}
POSITION_BYTES = 2 * 2 * 8 * 64 * 4


def _rss() -> int:
    """This process's resident bytes, after handing freed heap memory back to the system.

    After many tests glibc serves even large blocks from its heap (its mmap threshold grows as
    mmapped blocks are freed) and keeps them resident when freed: without the trim, a freed
    16 MiB temporary of some earlier line counted as KV memory that was not given back.
    """
    psutil = pytest.importorskip("psutil")
    with contextlib.suppress(OSError, AttributeError):  # not glibc: measure as it is
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(psutil.Process().memory_info().rss)


def _big_kv() -> SlotKV:
    from server.engine.chattts.step.pages import can_release

    if not can_release():
        pytest.skip("lazily resident KV pages need Linux")
    return SlotKV(**BIG, dtype=torch.float32, device=torch.device("cpu"))


def _prefill(kv: SlotKV, slot: int, length: int) -> None:
    """Write ``length`` positions of ``slot`` in every layer, from an expanded scalar (no temporaries)."""
    states = torch.ones(1, 1, 1, 1).expand(1, BIG["kv_heads"], length, BIG["head_dim"])
    kv.cover(slot, length)
    for layer in range(BIG["layers"]):
        kv.prefill_view(torch.tensor([slot]), length).update(states, states, layer_idx=layer)


def test_cpu_slots_are_address_space_until_written_and_reading_costs_nothing() -> None:
    before = _rss()
    kv = _big_kv()
    assert kv.lazy and kv.nbytes == 256 * MiB and kv.resident_bytes == 0
    assert float(sum(t.sum() for t in (*kv.keys, *kv.values))) == 0.0  # the attention reads all of it
    assert _rss() - before < 16 * MiB  # untouched pages read as the shared zero page


def test_cpu_resident_memory_scales_with_the_rows_lengths_and_goes_back_when_freed() -> None:
    kv = _big_kv()
    base = _rss()
    long_slot, short_slot = kv.take(), kv.take()
    _prefill(kv, long_slot, 4096)
    _prefill(kv, short_slot, 1024)
    assert kv.resident_bytes == (4096 + 1024) * POSITION_BYTES == 40 * MiB
    assert abs(_rss() - base - 40 * MiB) < 6 * MiB  # what the kernel counts, not only what we report
    kv.give_back(long_slot)
    assert kv.resident_bytes == 1024 * POSITION_BYTES
    assert abs(_rss() - base - 8 * MiB) < 6 * MiB
    assert float(kv.keys[1][long_slot].norm()) == 0.0  # released pages read as zeros (one reduction, no copy)
    assert float(kv.keys[1][short_slot, :, :1024].sum()) == 8 * 1024 * 64  # the live row is untouched
    kv.give_back(short_slot)
    assert kv.resident_bytes == 0 and _rss() - base < 6 * MiB


def test_a_step_write_counts_one_page_per_head_once_noted() -> None:
    kv = _big_kv()
    rows, positions = torch.arange(2), torch.tensor([5000, 0])
    new = torch.ones(2, BIG["kv_heads"], 1, BIG["head_dim"])
    for layer in range(BIG["layers"]):
        kv.step_view(rows, positions, 8192).update(new, new, layer_idx=layer)
    for slot, position in enumerate(positions.tolist()):  # the runner notes the lengths it read back
        kv.cover(slot, position + 1)
    runs = 2 * BIG["layers"] * BIG["kv_heads"]
    assert kv.resident_bytes == runs * (-(-5001 * 256 // 4096) * 4096 + 4096)
    kv.trim()  # both slots are free: trimming hands back what the step wrote
    assert kv.resident_bytes == 0
    assert float(kv.keys[0].abs().sum()) == 0.0


def test_a_kv_reservation_larger_than_the_memory_left_is_named_at_start_up() -> None:
    from server.engine.chattts.setup import kv_memory_warning, memory_left

    assert kv_memory_warning(5 * 2**30, 8 * 2**30) is None
    assert kv_memory_warning(5 * 2**30, None) is None  # unknown: nothing to say
    warning = kv_memory_warning(int(5.7 * 2**30), 3 * 2**30)
    assert warning is not None and "5.7 GiB" in warning and "3.0 GiB" in warning
    assert "--max-batch" in warning and "--segment-max-tokens" in warning
    left = memory_left()
    if left is not None:  # Linux: the machine's (or the cgroup's) memory less what this process holds
        assert 0 < left < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
