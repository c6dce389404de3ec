"""``chattts_stream::decode_attention``: the CPU step's attention, each row read as far as it reaches.

Against :func:`math_attention` (the arithmetic it must reproduce) on strided views of real
:class:`SlotKV` slots, in both slot dtypes and on every code path of the kernel (AVX-512 for
head sizes in sixteens, AVX2 for eights, plain loops otherwise); and, in a child process, on
keys and values whose memory past a row's last unmasked position cannot be read at all.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from server.engine.chattts.step import decode_attention
from server.engine.chattts.step.kv import SlotKV
from server.engine.chattts.step.llama import _repeat_kv, math_attention

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert decode_attention.load(), "the C++ attention did not build here (see the log)"


def _slots(
    dtype: torch.dtype, *, slots: int, kv_heads: int, max_len: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values: real SlotKV buffers (strided views, as the step hands them)."""
    kv = SlotKV(
        layers=1,
        slots=slots,
        kv_heads=kv_heads,
        max_len=max_len,
        head_dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(dim * 31 + kv_heads)
    kv.keys[0].copy_(torch.randn(kv.keys[0].shape, generator=generator))
    kv.values[0].copy_(torch.randn(kv.values[0].shape, generator=generator))
    return kv.keys[0], kv.values[0]


def _prefix_mask(ends: list[int], length: int) -> torch.Tensor:
    """Row ``r`` may attend positions ``[0, ends[r])`` (the step's mask: columns <= position)."""
    positions = torch.tensor(ends).view(-1, 1) - 1
    return (torch.arange(length).unsqueeze(0) <= positions).view(len(ends), 1, 1, length)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("dim", "heads", "kv_heads"),
    [(64, 12, 12), (16, 4, 2), (8, 4, 4), (12, 6, 3)],  # ChatTTS; AVX-512 + GQA; AVX2; plain loops + GQA
)
def test_it_computes_the_dense_attention_over_each_rows_own_positions(
    dtype: torch.dtype, dim: int, heads: int, kv_heads: int
) -> None:
    keys, values = _slots(dtype, slots=6, kv_heads=kv_heads, max_len=200, dim=dim)
    ends = [1, 17, 150, 64, 151]  # one position, a chunk and one, the longest row, a whole chunk count
    b, length = len(ends), 192  # the attention length: a bucket past the longest row
    k, v = keys[:b, :, :length], values[:b, :, :length]
    q = torch.randn(b, heads, 1, dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    mask = _prefix_mask(ends, length)
    groups = heads // kv_heads
    expected = math_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), mask, dim**-0.5)
    got = decode_attention.decode_attention(q, k, v, mask, dim**-0.5)
    assert got.dtype == q.dtype and got.shape == (b, heads, 1, dim) and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:  # the same float32 arithmetic, rounded to bf16 once: at most one bf16 step apart
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)


def test_it_honours_holes_in_the_mask_and_a_mask_broadcast_over_rows() -> None:
    keys, values = _slots(torch.float32, slots=3, kv_heads=2, max_len=64, dim=16)
    k, v = keys[:3, :, :40], values[:3, :, :40]
    q = torch.randn(3, 2, 1, 16)
    holes = _prefix_mask([40, 33, 20], 40)
    holes[0, ..., 5:30] = False
    holes[2, ..., :19] = False  # one position left: the last
    for mask in (holes, holes[1:2]):  # per row; one row's mask for every row
        expected = math_attention(q, k, v, mask, 0.25)
        torch.testing.assert_close(decode_attention.decode_attention(q, k, v, mask, 0.25), expected)


def test_a_float32_query_over_bf16_slots_reads_them_as_math_attention_does() -> None:
    """The eager step that a failed compile falls back to keeps bf16 slots and a float32-or-bf16 query."""
    keys, values = _slots(torch.bfloat16, slots=2, kv_heads=4, max_len=80, dim=64)
    k, v = keys[:2, :, :64], values[:2, :, :64]
    q = torch.randn(2, 4, 1, 64)
    mask = _prefix_mask([64, 9], 64)
    torch.testing.assert_close(
        decode_attention.decode_attention(q, k, v, mask, 0.125), math_attention(q, k, v, mask, 0.125)
    )


def test_bad_input_is_refused_with_a_message() -> None:
    q, kv = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 4, 8)
    mask = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        decode_attention.decode_attention(q, kv.half(), kv.half(), mask, 1.0)
    with pytest.raises(RuntimeError, match="q must be"):
        decode_attention.decode_attention(torch.randn(1, 2, 3, 8), kv, kv, mask, 1.0)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        decode_attention.decode_attention(q, kv, kv, mask.float(), 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        decode_attention.decode_attention(torch.randn(1, 3, 1, 8), kv, kv, mask, 1.0)


#: Keys and values for two rows in one mapping: row 0's last 32 positions lie on a page that
#: cannot be read (PROT_NONE), and its mask ends before them. A kernel that reads past a row's
#: last unmasked position (the longest row's length, as a dense attention does) dies of SIGSEGV.
_GUARDED = textwrap.dedent(
    """
    import ctypes, mmap, torch
    from server.engine.chattts.step import decode_attention
    from server.engine.chattts.step.llama import math_attention

    assert decode_attention.load()
    page, dim = mmap.PAGESIZE, 64
    per_page = page // (2 * dim)  # bf16 positions a page holds
    length = 2 * per_page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def guarded(seed):
        region = mmap.mmap(-1, 4 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(region, dtype=torch.bfloat16).view(2, 1, length, dim)
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
        start = ctypes.addressof(ctypes.c_char.from_buffer(region))
        assert libc.mprotect(start + page, page, 0) == 0, ctypes.get_errno()
        return t

    keys, values = guarded(1), guarded(2)
    q = torch.randn(2, 1, 1, dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ends = [per_page, length]  # row 0 ends where its unreadable page begins; row 1 reads all
    mask = (torch.arange(length).unsqueeze(0) < torch.tensor(ends).view(2, 1)).view(2, 1, 1, length)
    got = decode_attention.decode_attention(q, keys, values, mask, 0.125)
    for r, end in enumerate(ends):  # the reference reads only what it may
        k, v = keys[r : r + 1, :, :end].clone(), values[r : r + 1, :, :end].clone()
        expected = math_attention(q[r : r + 1], k, v, mask[r : r + 1, ..., :end], 0.125)
        torch.testing.assert_close(got[r : r + 1], expected)
    print("read within reach")
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through ctypes: Linux")
def test_a_row_is_never_read_past_its_last_unmasked_position() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _GUARDED], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "read within reach" in done.stdout, (
        f"rc {done.returncode} (-11: it read the unreadable page)\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )


def test_one_row_and_a_batch_both_take_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row alone goes through the operator too: given the dense form, inductor would turn the
    query inside the loop over key positions (a cosine and a sine per position)."""
    kv = torch.randn(2, 2, 4, 8)
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    calls: list[int] = []

    def count(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return torch.zeros_like(q)

    monkeypatch.setattr(decode_attention, "decode_attention", count)
    decode_attention.step_attention(torch.randn(1, 2, 1, 8), kv[:1], kv[:1], mask[:1], 1.0)
    decode_attention.step_attention(torch.randn(2, 2, 1, 8), kv, kv, mask, 1.0)
    assert calls == [1, 2]


def test_a_failed_build_is_logged_and_reported_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger=decode_attention.__name__):
        assert decode_attention.build(broken, "chattts_stream_test_broken") is False
    assert "could not be built" in caplog.text and "math_attention" in caplog.text


def test_a_baton_left_by_a_killed_build_does_not_stop_the_next_load(tmp_path: Path) -> None:
    # torch's loader waits, forever, for the file `lock` in the build folder to go away; a
    # process killed mid-build leaves it. The next build must clear it and go on.
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int chattts_stream_lock_probe() { return 7; }\n')
    extensions = tmp_path / "extensions"
    name = "chattts_stream_test_stale_lock"
    (extensions / name).mkdir(parents=True)
    (extensions / name / "lock").write_text("")
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from server.engine.chattts.step import decode_attention
        print(decode_attention.build(Path({str(source)!r}), {name!r}))
        """
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    try:
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the build waited on the stale baton")
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]
    assert not (extensions / name / "lock").exists()
    assert any((extensions / name).glob("*.so"))
