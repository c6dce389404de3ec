"""Incremental decode of GPT hidden states to audio: linear cost, inaudible seams.

ChatTTS decodes the GPT hidden state of every audio token with ``Decoder``
(``DVAE`` without VQ: conv-in, ConvNeXt blocks, conv-out; 1 token → 2 mel
frames) and Vocos (ConvNeXt backbone, ISTFT head, ``n_fft`` 1024, hop 256,
``center=True``). For N tokens a one-shot decode gives ``512·N − 256``
samples at 24 kHz, sample ``s`` centred on mel frame ``s / 256``.

Receptive field (mel frames, each side), from the official config:

* Decoder: conv-in 3+3 (±2), 12 ConvNeXt blocks kernel 7 dilation 2 (±72),
  conv-out 1, out-conv 3 (±1): ±75 frames;
* Vocos: embed conv 7 (±3), 8 ConvNeXt blocks kernel 7 (±24): ±27 frames;
* ISTFT: a sample overlaps 4 frames (±2).

So an output sample depends on about ±104 frames = ±52 tokens (1.1 s).
Holding back that much audio would cost over a second of latency, so the
stream uses (a) ``context_tokens`` of already-emitted tokens as left
context, (b) ``holdback_tokens`` of not-yet-final audio at the right edge,
(c) a raised-cosine crossfade between the previous window's tentative tail
and the new window over ``crossfade_samples``. Each block decodes only
``context + new + holdback`` tokens: total cost is linear in length. The
error against a one-shot decode is measured by ``tests/model/test_chattts_seams.py``.

A :class:`StreamDecoder` plans its window (:meth:`StreamDecoder.plan`) and
finishes it from the decoded samples (:meth:`StreamDecoder.finish`), so the
engine can decode the windows of all its rows in one batched call
(:mod:`server.engine.chattts.vocode`); :meth:`StreamDecoder.pull` does both
for one row. The engine keeps the states in a device ring instead
(:mod:`server.engine.chattts.step.ring`): its rows' decoders only count tokens
(:meth:`StreamDecoder.advance`) and plan spans (:meth:`StreamDecoder.span`), the same
windows by token index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

SAMPLES_PER_TOKEN = 512
#: ``center=True`` ISTFT: N tokens → 2N frames → 256·(2N − 1) samples.
EDGE_SAMPLES = 256

DecodeFn = Callable[[torch.Tensor], npt.NDArray[np.float32]]


def samples_for_tokens(n_tokens: int) -> int:
    """Samples a one-shot decode of ``n_tokens`` tokens yields (``512·N − 256``, 0 for none)."""
    return SAMPLES_PER_TOKEN * n_tokens - EDGE_SAMPLES if n_tokens > 0 else 0


def make_decode_fn(decoder: torch.nn.Module, vocos: Any) -> DecodeFn:
    """One-shot decode ``(T, hidden)`` GPT hidden states → float32 samples (ChatTTS's ``_decode_to_wavs``).

    In whatever dtype the Decoder holds now (:class:`.vocode.BatchVocoder` may have made it
    bfloat16, the Vocos backbone with it); Vocos's ISTFT head always runs in float32.
    """

    def decode(hiddens: torch.Tensor) -> npt.NDArray[np.float32]:
        dtype = next(decoder.parameters()).dtype
        x = hiddens.to(dtype=dtype).t().unsqueeze(0).contiguous()
        mel = decoder(x)
        wav = vocos.head(vocos.backbone(mel).float())  # Vocos.decode, with the head in float32
        out: npt.NDArray[np.float32] = wav[0].to(device="cpu", dtype=torch.float32).numpy()
        return out

    return decode


@dataclass(frozen=True)
class DecodeSpan:
    """One row's next decode by token index: tokens ``[start_token, start_token + tokens)``.

    Attributes:
        start_token: the window's first token.
        tokens: the window's length (to the newest token).
        end: emit samples up to here (stream sample index).
        final: the stream ends with this window.
    """

    start_token: int
    tokens: int
    end: int
    final: bool


@dataclass(frozen=True)
class DecodeWindow:
    """One row's next decode: the hidden states of tokens ``[start_token, …)`` and what to emit.

    Attributes:
        hiddens: ``(T, hidden)`` states to decode.
        start_token: token index of ``hiddens[0]``.
        end: emit samples up to here (stream sample index).
        final: the stream ends with this window.
    """

    hiddens: torch.Tensor
    start_token: int
    end: int
    final: bool


class StreamDecoder:
    """Per-sequence incremental decoder state.

    Feed hidden states with :meth:`push`, take audio with :meth:`pull` (or
    :meth:`plan`, a decode of the window, and :meth:`finish`). The
    concatenated output of all pulls (the last with ``final=True``) has
    exactly :func:`samples_for_tokens` samples.
    """

    def __init__(
        self,
        decode: DecodeFn | None,
        *,
        context_tokens: int = 16,
        holdback_tokens: int = 4,
        crossfade_samples: int = 256,
    ) -> None:
        if crossfade_samples > SAMPLES_PER_TOKEN * holdback_tokens:
            raise ValueError("crossfade_samples must fit in the held-back audio (512 · holdback_tokens)")
        self._decode = decode
        self.context_tokens = context_tokens
        self.holdback_tokens = holdback_tokens
        self.crossfade_samples = crossfade_samples
        self._chunks: list[torch.Tensor] = []
        self._buf: torch.Tensor | None = None
        self._buf_start = 0  # token index of self._buf[0]
        self.n_tokens = 0
        self.emitted = 0  # samples handed out so far
        self._tail: npt.NDArray[np.float32] | None = None  # tentative samples from `emitted` on

    def push(self, hiddens: torch.Tensor) -> None:
        """Append ``(k, hidden)`` states of ``k`` new audio tokens."""
        if hiddens.shape[0]:
            self._chunks.append(hiddens)
            self.n_tokens += int(hiddens.shape[0])

    def advance(self, tokens: int) -> None:
        """Count ``tokens`` new audio tokens whose states are kept elsewhere (a decode ring).

        Such a decoder plans :meth:`span` s, not windows: it holds no states.
        """
        self.n_tokens += tokens

    def _window(self, start: int) -> torch.Tensor:
        if self._chunks:
            parts = ([self._buf] if self._buf is not None else []) + self._chunks
            self._buf = torch.cat(parts, 0)
            self._chunks.clear()
        assert self._buf is not None
        return self._buf[start - self._buf_start :]

    def _forget_before(self, token: int) -> None:
        if self._buf is not None and token > self._buf_start:
            self._buf = self._buf[token - self._buf_start :].clone()
            self._buf_start = token

    def span(self, *, final: bool) -> DecodeSpan | None:
        """The tokens to decode now: audio up to the hold-back (all when ``final``); ``None``: nothing."""
        total = samples_for_tokens(self.n_tokens)
        end = total if final else total - SAMPLES_PER_TOKEN * self.holdback_tokens
        if end <= self.emitted:
            return None
        start_tok = max(0, self.emitted // SAMPLES_PER_TOKEN - self.context_tokens)
        return DecodeSpan(start_token=start_tok, tokens=self.n_tokens - start_tok, end=end, final=final)

    def plan(self, *, final: bool) -> DecodeWindow | None:
        """:meth:`span` with the span's states (pushed with :meth:`push`); ``None``: nothing to decode."""
        span = self.span(final=final)
        if span is None:
            return None
        hiddens = self._window(span.start_token)
        return DecodeWindow(hiddens=hiddens, start_token=span.start_token, end=span.end, final=final)

    def finish(
        self, window: DecodeWindow | DecodeSpan, wav: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float32]:
        """The new audio, given ``wav`` = the one-shot decode of the window's tokens."""
        offset = SAMPLES_PER_TOKEN * window.start_token
        end = window.end
        seg = wav[self.emitted - offset : end - offset].copy()
        if self._tail is not None:
            n = min(len(self._tail), len(seg))
            ramp = 0.5 - 0.5 * np.cos(np.pi * (np.arange(n, dtype=np.float32) + 0.5) / n)
            seg[:n] = self._tail[:n] * (1.0 - ramp) + seg[:n] * ramp
        tail = None if window.final else wav[end - offset : end - offset + self.crossfade_samples].copy()
        self._tail = tail if tail is not None and len(tail) else None
        self.emitted = end
        self._forget_before(max(0, end // SAMPLES_PER_TOKEN - self.context_tokens))
        return seg

    def pull(self, *, final: bool) -> npt.NDArray[np.float32]:
        """Audio that is ready: everything up to the hold-back, or all of it when ``final``."""
        window = self.plan(final=final)
        if window is None:
            return np.zeros(0, dtype=np.float32)
        if self._decode is None:
            raise RuntimeError("this StreamDecoder has no decode function; decode its plan() yourself")
        return self.finish(window, self._decode(window.hiddens))
