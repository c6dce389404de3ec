"""Batched decode: every row of one padded Decoder + Vocos call equals its own one-shot decode (≤ 1e-5).

Full-size Decoder and Vocos (random weights at trained-like layer scales): their receptive
field (±52 tokens) is wider than any window here, so padding that leaked into a row would
show at every sample of it, not only at its edge.

In bfloat16 the bound is a signal-to-noise ratio instead: the CPU's bf16 convolution kernels
depend on the batch's shape (oneDNN on AMX rounds a 7-row padded call differently from a
one-row call: 7e-4 at most on a 0.024-rms signal, about 40 dB; other CPUs agree to 1e-7), so
a batched row lies within bf16 rounding of its decode alone, never bit for bit. Leaked
padding is far louder: 0.7-20 dB on these windows, in either dtype.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from server.engine.chattts.decode import make_decode_fn, samples_for_tokens
from tests.model.helpers import full_size_decoder_and_vocos
from tests.unit.audio_signals import snr_db

#: Window lengths as the engine makes them: first blocks (8 + hold-back), steady state
#: (16 context + 32 + 4), a final short one, and one that is a multiple of the padding unit.
LENGTHS = [12, 52, 3, 28, 40, 1, 16]
#: A bf16 row's least signal-to-noise ratio against its bf16 decode alone: bf16 kernels that
#: differ with the batch's shape give about 40 dB, leaked padding at most 20.4 dB.
BF16_ROW_SNR_DB = 27.0


@pytest.fixture(scope="module")
def modules() -> tuple[Any, Any]:
    return full_size_decoder_and_vocos()


def _windows(lengths: list[int], seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 768, generator=gen) for n in lengths]


@pytest.mark.parametrize("max_waste", [None, 0.25], ids=["one-call", "grouped-by-length"])
def test_each_row_of_a_batched_decode_equals_its_decode_alone(
    modules: tuple[Any, Any], max_waste: float | None
) -> None:
    from server.engine.chattts.vocode import BatchVocoder

    decoder, vocos = modules
    windows = _windows(LENGTHS)
    with torch.inference_mode():
        alone = [make_decode_fn(decoder, vocos)(w) for w in windows]
        vocoder = BatchVocoder(decoder, vocos, max_waste=max_waste)
        batched = vocoder.decode(windows)
        grouped = {(2, 52), (1, 28), (2, 16), (1, 4)}  # (rows, padded tokens) of each call
        assert vocoder.shapes == ({(7, 52)} if max_waste is None else grouped)
    for n, ref, got in zip(LENGTHS, alone, batched, strict=True):
        assert len(got) == len(ref) == samples_for_tokens(n)
        assert np.abs(got - ref).max() <= 1e-5, f"window of {n} tokens: {np.abs(got - ref).max():.2e}"
        assert np.abs(ref).max() > 1e-3  # the comparison is of real signals


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_masks_are_what_keeps_rows_apart(modules: tuple[Any, Any], dtype: torch.dtype) -> None:
    """With the per-row masks off, padding leaks into the shorter rows (so the tests of rows
    kept apart can fail: float32's 1e-5 and bfloat16's signal-to-noise bound alike)."""
    from server.engine.chattts.vocode import BatchVocoder

    class Unmasked(BatchVocoder):
        def _mask_input(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            return None

    decoder, vocos = copy.deepcopy(modules)  # the vocoder converts its modules in place
    windows = _windows(LENGTHS)
    with torch.inference_mode():
        leaky = Unmasked(decoder, vocos, dtype=dtype).decode(windows)
        alone = [make_decode_fn(decoder, vocos)(w) for w in windows]
    longest = LENGTHS.index(max(LENGTHS))
    for i, (n, ref, got) in enumerate(zip(LENGTHS, alone, leaky, strict=True)):
        if i != longest:  # the longest row has no padding to leak
            assert np.abs(got - ref).max() > 1e-3, f"window of {n} tokens"
            assert snr_db(ref, got) < BF16_ROW_SNR_DB, f"window of {n} tokens: {snr_db(ref, got):.1f} dB"


def test_hooks_do_nothing_outside_a_batched_decode(modules: tuple[Any, Any]) -> None:
    """ChatTTS's own one-shot decode through the same modules is unchanged by the vocoder's hooks."""
    from server.engine.chattts.vocode import BatchVocoder

    decoder, vocos = modules
    window = _windows([20])[0]
    with torch.inference_mode():
        before = make_decode_fn(decoder, vocos)(window)
        vocoder = BatchVocoder(decoder, vocos)
        vocoder.decode(_windows([5, 9]))
        after = make_decode_fn(decoder, vocos)(window)
    assert np.array_equal(before, after)


def test_a_bfloat16_vocoder_keeps_rows_apart_and_stays_near_the_float32_decode(
    modules: tuple[Any, Any],
) -> None:
    """``--vocoder-dtype bfloat16`` (the CPU's auto with a bf16 GPT): every row within bf16
    rounding of its bf16 decode alone (module docstring), and every window within 30 dB of
    the float32 decode (38 dB measured), in both decode paths."""
    from server.engine.chattts.vocode import BatchVocoder

    decoder, vocos = copy.deepcopy(modules)  # the vocoder converts its modules in place
    windows = _windows(LENGTHS)
    with torch.inference_mode():
        exact = [make_decode_fn(*modules)(w) for w in windows]
        vocoder = BatchVocoder(decoder, vocos, max_waste=0.25, dtype=torch.bfloat16)
        alone = [make_decode_fn(decoder, vocos)(w) for w in windows]
        batched = vocoder.decode(windows)
    assert next(decoder.parameters()).dtype == next(vocos.backbone.parameters()).dtype == torch.bfloat16
    assert next(vocos.head.parameters()).dtype == torch.float32  # the ISTFT head stays float32
    for n, ref, one, got in zip(LENGTHS, exact, alone, batched, strict=True):
        assert got.dtype == np.float32 and len(got) == len(ref)
        assert snr_db(one, got) >= BF16_ROW_SNR_DB, f"window of {n} tokens: {snr_db(one, got):.1f} dB"
        snr = snr_db(ref, one)
        assert 30.0 < snr < 80.0, f"window of {n} tokens: {snr:.1f} dB from float32"  # < 80: not float32


@pytest.mark.parametrize(
    ("option", "gpt", "expected"),
    [
        ("auto", torch.bfloat16, torch.bfloat16),
        ("auto", torch.float32, torch.float32),  # the token-identical path keeps ChatTTS's audio
        ("auto", torch.float16, torch.float32),  # fp16 (the GPU's auto) could overflow the ConvNeXt
        ("float32", torch.bfloat16, torch.float32),
        ("bfloat16", torch.float32, torch.bfloat16),
    ],
)
def test_the_vocoder_follows_only_a_bfloat16_gpt_unless_told(
    option: str, gpt: torch.dtype, expected: torch.dtype
) -> None:
    from server.engine.chattts.vocode import vocoder_dtype

    assert vocoder_dtype(option, gpt) == expected
