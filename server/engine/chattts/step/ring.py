"""The decode ring: each row's recent hidden states on the device, and the windows gathered from it.

The Decoder turns a row's GPT hidden states into audio a window at a time
(:mod:`server.engine.chattts.decode`): ``context_tokens`` already heard, the new tokens, and
the held-back ones. Those windows used to be assembled per row on the host side: every block
pushed each row's states into its ``StreamDecoder`` (a tensor per row per block, concatenated
again at each decode) and the vocoder copied each window into its padded batch, one copy per
row. The ring keeps them where they are made instead:

* :meth:`DecodeRing.write`: at the end of a block, every row's new states go from the step's
  block buffer (``SlotState.pending_hidden``) into ring place ``slot · C + token mod C``, all
  rows in ONE indexed copy;
* :meth:`DecodeRing.gather`: at a quantum boundary where rows are due, their windows come out
  in ONE indexed gather, already padded to the batched Decoder + Vocos call's shape (padding
  points at a row of zeros after the last slot's ring).

The host only does index arithmetic: which token of which row goes where (each row's
``StreamDecoder`` still plans its window and stitches its audio; it no longer holds states).
A window spans at most :func:`ring_tokens` tokens, so a ring of that many per slot never
overwrites a state a window still needs (:meth:`DecodeRing.gather` refuses one that would).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.chattts.step.summary import upload


def ring_tokens(*, context_tokens: int, holdback_tokens: int, block_schedule: tuple[int, ...]) -> int:
    """Tokens a slot's ring holds: the longest window a row can ask for, rounded up to a multiple of 8.

    After a decode at token n, ``n - holdback - 1`` whole tokens are emitted, so the next window
    starts ``context`` tokens before that and runs to the newest token, at most one block (the
    longest of the schedule) after n. Before anything is emitted the windows start at token 0
    and end at most a block past the hold-back: shorter still.
    """
    longest = context_tokens + holdback_tokens + 1 + max(block_schedule)
    return -(-longest // 8) * 8


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, start + tokens)`` of the row in ``slot``."""

    slot: int
    start: int
    tokens: int


class DecodeRing:
    """A ring of ``capacity`` hidden states per KV slot, on the model's device.

    Args:
        slots: KV slots.
        capacity: tokens per slot (:func:`ring_tokens`).
        hidden_size: the GPT's hidden size.
        device: the step's device.
    """

    def __init__(self, slots: int, capacity: int, hidden_size: int, device: torch.device) -> None:
        self.capacity = capacity
        self._zero = slots * capacity  # the padding row: never written
        self.states = torch.zeros((slots * capacity + 1, hidden_size), device=device)
        #: Tokens written into each slot's ring so far (host side; the next token's index).
        self.written = [0] * slots

    @property
    def nbytes(self) -> int:
        """Bytes the ring holds (fixed at start-up)."""
        return self.states.numel() * self.states.element_size()

    def reset(self, slot: int) -> None:
        """A new sequence takes ``slot``: its tokens count from 0."""
        self.written[slot] = 0

    def write(self, pending: torch.Tensor, made: list[tuple[int, int]]) -> None:
        """Append each ``(slot, k)``'s first ``k`` states of ``pending`` ``(S, block, hidden)`` to its ring.

        One upload of the indices and one indexed copy, whatever the number of rows.
        """
        made = [(slot, k) for slot, k in made if k]
        if not made:
            return
        block, c = int(pending.shape[1]), self.capacity
        source = [slot * block + i for slot, k in made for i in range(k)]
        target = [slot * c + (self.written[slot] + i) % c for slot, k in made for i in range(k)]
        for slot, k in made:
            self.written[slot] += k
        index = upload(source + target, self.states.device)
        n = len(source)
        states = pending.flatten(0, 1).index_select(0, index[:n])
        self.states.index_copy_(0, index[n:], states)

    def gather(self, spans: list[Span], tokens: int) -> torch.Tensor:
        """``(len(spans), tokens, hidden)`` float32: each span's states, then zeros; one indexed gather.

        Raises:
            ValueError: a span reaches past its row's newest token, or back past what its ring holds.
        """
        c, index = self.capacity, []
        for span in spans:
            newest = self.written[span.slot]
            if span.start + span.tokens > newest or span.start < newest - c or span.tokens > tokens:
                raise ValueError(f"{span} is not in slot {span.slot}'s ring (tokens {newest - c}..{newest})")
            index += [span.slot * c + (span.start + i) % c for i in range(span.tokens)]
            index += [self._zero] * (tokens - span.tokens)
        states = self.states.index_select(0, upload(index, self.states.device))
        return states.view(len(spans), tokens, -1)
