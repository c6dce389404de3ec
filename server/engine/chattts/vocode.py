"""Batched decode of many rows' windows in one Decoder + Vocos call, each row exactly as if alone.

Rows' windows differ in length, so they are right-padded to one length (a
multiple of ``token_multiple`` tokens, which also keeps the set of shapes
small). Padding must not reach a row's real samples. Everything in Decoder
and Vocos is pointwise in time except the convolutions with a kernel wider
than 1 and the ISTFT's overlap-add, so:

* a forward pre-hook on every such convolution zeroes its input past each
  row's own length while a batched decode runs: the convolution then sees
  exactly the zero padding it sees when the row is decoded alone (the
  hooks do nothing otherwise);
* the ISTFT head (``torch.istft(center=True)``: inverse FFT, window,
  overlap-add, division by the summed squared window) is computed here with
  each row's frames past its length given zero weight in both the sum and
  the window envelope, which is what a shorter ``torch.istft`` computes.

``tests/model/test_chattts_vocode.py`` holds every row within 1e-5 of its
one-shot decode alone in float32; in bfloat16 within bf16 rounding (27 dB or
more; leaked padding gives 0.7-20 dB), since the CPU's bf16 kernels may round
a batched call differently from a one-row call (oneDNN on AMX does).

The Decoder and the Vocos backbone may run in bfloat16 (:func:`vocoder_dtype`): on a CPU
with native bf16 a decode is 2-3.3x faster (63.5 against 22.8 ms for one 52-token window,
389 against 117 ms for eight, two EPYC cores), and the decode was an eighth of a single
stream's time and a quarter of eight streams'. The ISTFT head stays in float32. It changes
samples (38 dB from float32's on random weights), never tokens:
``bench/results/studies/vocoder-dtype-epyc-2core.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from server.engine.chattts.decode import samples_for_tokens

#: Mel frames per audio token (ChatTTS's Decoder views one hidden state as two frames).
FRAMES_PER_TOKEN = 2
#: ``--vocoder-dtype``'s values.
VOCODER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def vocoder_dtype(option: str, gpt_dtype: torch.dtype) -> torch.dtype:
    """The Decoder's and Vocos backbone's dtype: ``"auto"`` follows a bfloat16 GPT, else float32.

    Only bfloat16 is followed: float16 (the GPU's auto) can overflow in the ConvNeXt blocks,
    and a float32 GPT is the token-identical path, whose audio must stay ChatTTS's too.
    """
    if option == "auto":
        return torch.bfloat16 if gpt_dtype == torch.bfloat16 else torch.float32
    return VOCODER_DTYPES[option]


def _temporal_convs(module: torch.nn.Module) -> list[torch.nn.Conv1d]:
    return [m for m in module.modules() if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1]


def decode_groups(lengths: list[int], max_waste: float | None) -> list[list[int]]:
    """Indices of windows decoded together, longest first.

    All of them in one group, or (``max_waste``, a fraction) runs whose lengths are within
    that fraction of their group's longest.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_waste is None:
        return [order]
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] >= (1 - max_waste) * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class BatchVocoder:
    """Decodes ``(T_i, hidden)`` windows of several rows in one call.

    Args:
        decoder: ChatTTS's loaded ``Decoder`` (a ``DVAE`` without VQ).
        vocos: ChatTTS's loaded Vocos (backbone + ISTFT head with ``center`` padding).
        token_multiple: windows are padded up to a multiple of this many tokens.
        dtype: what the Decoder and the Vocos backbone run in; they are converted in place, so
            every decode of this model (:func:`.decode.make_decode_fn` too) runs in it.
    """

    def __init__(
        self,
        decoder: torch.nn.Module,
        vocos: Any,
        *,
        token_multiple: int = 4,
        max_waste: float | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        istft = vocos.head.istft
        if getattr(istft, "padding", "center") != "center":
            raise ValueError("BatchVocoder needs Vocos's ISTFT head with center padding (ChatTTS's)")
        self._decoder, self._vocos = decoder.to(dtype), vocos
        vocos.backbone.to(dtype)
        self.dtype = dtype
        self.token_multiple = token_multiple
        self.max_waste = max_waste
        self._mask: torch.Tensor | None = None
        self.shapes: set[tuple[int, int]] = set()  # (rows, tokens) of every batched call
        for conv in _temporal_convs(decoder) + _temporal_convs(vocos.backbone):
            conv.register_forward_pre_hook(self._mask_input)

    def _mask_input(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._mask is None:
            return None
        return (args[0] * self._mask, *args[1:])

    def padded_tokens(self, lengths: list[int]) -> int:
        """The batch's length for windows of ``lengths`` tokens: the longest, up to ``token_multiple``."""
        return -(-max(lengths) // self.token_multiple) * self.token_multiple

    def decode(self, windows: list[torch.Tensor]) -> list[npt.NDArray[np.float32]]:
        """Each window's one-shot decode: ``samples_for_tokens(T_i)`` float32 samples per row.

        One call for all rows, or, with ``max_waste``, one call per group of windows of
        similar length: on the CPU, compute grows with the padded length, so a newcomer's
        8-token window is not padded to a steady row's 52.
        """

        def pad(group: list[int], tokens: int) -> torch.Tensor:
            first = windows[group[0]]
            x = first.new_zeros((len(group), tokens, first.shape[1]), dtype=self.dtype)
            for row, i in enumerate(group):
                x[row, : windows[i].shape[0]] = windows[i]
            return x

        return self.decode_gathered([int(w.shape[0]) for w in windows], pad)

    def decode_gathered(
        self, lengths: list[int], gather: Callable[[list[int], int], torch.Tensor]
    ) -> list[npt.NDArray[np.float32]]:
        """:meth:`decode` for windows of ``lengths`` tokens that ``gather`` brings in, padded.

        ``gather(indices, tokens)``: the windows ``indices`` as ``(len(indices), tokens, hidden)``,
        zero past each one's length (a decode ring does it in one indexed gather on the device).
        """
        out: list[npt.NDArray[np.float32]] = [np.zeros(0, dtype=np.float32)] * len(lengths)
        for group in decode_groups(lengths, self.max_waste):
            part = [lengths[i] for i in group]
            x = gather(group, self.padded_tokens(part))
            for index, wav in zip(group, self._decode_padded(x, part), strict=True):
                out[index] = wav
        return out

    def _decode_padded(self, x: torch.Tensor, lengths: list[int]) -> list[npt.NDArray[np.float32]]:
        """The batched call on ``x`` ``(rows, tokens, hidden)``, row ``i`` real up to ``lengths[i]``."""
        x = x.to(self.dtype)
        rows, tokens = int(x.shape[0]), int(x.shape[1])
        self.shapes.add((rows, tokens))
        frames = FRAMES_PER_TOKEN * tokens
        valid = torch.tensor(lengths, device=x.device).mul_(FRAMES_PER_TOKEN)
        mask = (torch.arange(frames, device=x.device).unsqueeze(0) < valid.unsqueeze(1)).to(torch.float32)
        self._mask = mask.unsqueeze(1).to(self.dtype)
        try:
            mel = self._decoder(x.transpose(1, 2).contiguous())
            features = self._vocos.backbone(mel)
        finally:
            self._mask = None
        wav = self._istft_head(features.float(), mask).cpu().numpy()
        return [wav[row, : samples_for_tokens(n)] for row, n in enumerate(lengths)]

    def _istft_head(self, features: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
        """Vocos's ``ISTFTHead``, ``torch.istft(center=True)`` written out, frames weighted by the mask."""
        head = self._vocos.head
        x = head.out(features).transpose(1, 2)
        mag, phase = x.chunk(2, dim=1)
        mag = torch.clip(torch.exp(mag), max=1e2)
        spec = mag * (torch.cos(phase) + 1j * torch.sin(phase))
        istft = head.istft
        n_fft, hop, window = int(istft.n_fft), int(istft.hop_length), istft.window
        weight = frame_mask.unsqueeze(1)  # (B, 1, frames)
        frames = torch.fft.irfft(spec, n_fft, dim=1, norm="backward") * window[None, :, None] * weight
        length = (frames.shape[-1] - 1) * hop + n_fft
        fold = {"output_size": (1, length), "kernel_size": (1, n_fft), "stride": (1, hop)}
        y = F.fold(frames, **fold)[:, 0, 0]
        envelope = F.fold(window.square()[None, :, None] * weight, **fold)[:, 0, 0]
        half = n_fft // 2
        y, envelope = y[:, half : length - half], envelope[:, half : length - half]
        # Past a row's end the envelope is 0 (and so is y): those samples are cut off anyway.
        return y / envelope.clamp(min=1e-11)
