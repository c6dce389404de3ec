"""Times for a sequence of weighted units in one stretch of audio: speech, pauses, boundaries.

The numeric half of :mod:`server.text.words` (which knows the words; this module knows only
weights, pause probabilities and samples). Pure numpy, no state; about a millisecond per
second of audio.

- :func:`find_speech`: per 10 ms frame, silent or not (below the loud level minus a margin);
  where speech starts and ends; the silences inside it long enough to be pauses.
- :func:`layout`: which pauses are boundaries between units (a dynamic programme, see
  :func:`_choose`), and each unit's share of the time between two chosen pauses by weight.
- :func:`snap`: boundaries inside running speech moved to the quietest frame nearby.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

#: The dynamic programme's bounds, which keep its cost linear in the segment's length: a pause is
#: a candidate only for the boundaries within this band of where the weights alone put them ...
_BAND_MIN_S: Final = 2.0
_BAND_FRACTION: Final = 0.3
#: ... a group of units may pass over this many silences, and only the longest silences count.
_MAX_SKIPPED: Final = 12
_MAX_PAUSES: Final = 64
#: A boundary moves to a frame at least this much quieter than the frame it is in.
_DIP_DB: Final = 3.0
#: Silences at least this long do not count as speaking time in the first rate estimate.
_LONG_PAUSE_S: Final = 0.15

Span = tuple[float, float]


@dataclass(frozen=True)
class Speech:
    """Where a stretch of audio speaks, in seconds from its first sample.

    Attributes:
        start: the first speech frame's start (0 when nothing is above the silence level).
        end: the last speech frame's end (the whole length when nothing is).
        pauses: silences inside the speech long enough to be a pause, ``(start, end)``, in order.
        level: each frame's power in dB.
        frame: the frame length in seconds.
    """

    start: float
    end: float
    pauses: list[Span]
    level: npt.NDArray[np.float64]
    frame: float


def find_speech(
    samples: npt.NDArray[np.float32],
    sample_rate: int,
    *,
    frame_s: float,
    silence_db: float,
    min_pause_s: float,
    min_sound_s: float,
) -> Speech:
    """Speech and pauses of ``samples`` by frame energy.

    A frame is silent below the loud level (the 95th percentile of the frame levels) minus
    ``silence_db``; a burst of sound shorter than ``min_sound_s`` between silences is a click;
    a pause is a silence of at least ``min_pause_s`` inside the speech (the longest 64).
    """
    hop = max(1, round(sample_rate * frame_s))
    frame = hop / sample_rate
    count = max(1, -(-len(samples) // hop))
    padded = np.zeros(count * hop, dtype=np.float64)
    padded[: len(samples)] = samples
    level: npt.NDArray[np.float64] = 10 * np.log10(np.mean(padded.reshape(count, hop) ** 2, axis=1) + 1e-12)
    loud = float(np.percentile(level, 95))
    silent: npt.NDArray[np.bool_] = level < loud - silence_db
    if loud < -90:  # digital silence throughout
        silent[:] = True
    shortest_sound = max(1, round(min_sound_s / frame))
    for a, b in _runs(~silent):
        if b - a < shortest_sound and a > 0 and b < count:
            silent[a:b] = True
    voiced = np.flatnonzero(~silent)
    total = len(samples) / sample_rate
    if len(voiced) == 0:
        return Speech(0.0, total, [], level, frame)
    first, last = int(voiced[0]), int(voiced[-1])
    shortest_pause = max(1, round(min_pause_s / frame))
    runs = [(a, b) for a, b in _runs(silent[first : last + 1]) if b - a >= shortest_pause]
    runs = sorted(sorted(runs, key=lambda r: r[0] - r[1])[:_MAX_PAUSES])  # the longest, in order
    pauses = [((first + a) * frame, (first + b) * frame) for a, b in runs]
    return Speech(first * frame, min(total, (last + 1) * frame), pauses, level, frame)


def _runs(mask: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """``(start, end)`` of every run of True in ``mask``."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def layout(
    weights: npt.NDArray[np.float64],
    pause_probability: npt.NDArray[np.float64],
    speech: Speech,
    *,
    inner_pause_s: float,
    spread: float,
) -> list[Span]:
    """Each unit's ``(start, end)`` in seconds: chosen pauses as boundaries, weights between them.

    Args:
        weights: each unit's expected share of the speaking time (positive).
        pause_probability: for each boundary (after unit ``k``, ``len(weights) - 1`` of them),
            how likely a pause is there (0 < p < 1).
        speech: where the audio speaks and pauses.
        inner_pause_s: a silence passed over (inside a unit) costs one unit of log-likelihood
            per this many seconds.
        spread: a group's duration variance, in seconds per second of its expected duration.
    """
    cum = np.concatenate(([0.0], np.cumsum(weights)))
    start, end, pauses = speech.start, speech.end, speech.pauses
    chosen: list[tuple[int, int]] = []  # (pause, k): the pause follows the first k units
    if pauses and len(weights) > 1:
        long_pauses = sum(b - a for a, b in pauses if b - a >= _LONG_PAUSE_S)
        # Twice: the speaking rate is re-estimated from the pauses the first pass chose.
        for _ in range(2):
            rate = max(end - start - long_pauses, 1e-3) / cum[-1]
            chosen = _choose(cum, pause_probability, speech, rate, inner_pause_s, spread)
            long_pauses = sum(pauses[j][1] - pauses[j][0] for j, _ in chosen)
    spans: list[Span] = []
    opens = [(start, 0), *((pauses[j][1], k) for j, k in chosen)]
    closes = [*(pauses[j][0] for j, _ in chosen), end]
    ends = [k for _, k in chosen] + [len(weights)]
    for (t0, k0), t1, k1 in zip(opens, closes, ends, strict=True):
        share = (t1 - t0) / (cum[k1] - cum[k0])
        spans += [
            (t0 + share * (cum[i] - cum[k0]), t0 + share * (cum[i + 1] - cum[k0])) for i in range(k0, k1)
        ]
    return spans


def _choose(
    cum: npt.NDArray[np.float64],
    prior: npt.NDArray[np.float64],
    speech: Speech,
    rate: float,
    inner_pause_s: float,
    spread: float,
) -> list[tuple[int, int]]:
    """The pauses that are boundaries, as ``(pause, k)``: the pause follows the first ``k`` units.

    A dynamic programme over (pause, boundary) pairs, both increasing. The cost of going from
    one chosen pair to the next is the squared mismatch between the time between the two pauses
    and the expected time of the units between them (``rate`` × weight, variance ∝ expected
    time), minus the log-likelihoods of a pause at the new boundary, of none at the boundaries
    passed over, and of the silences passed over lying inside units.
    """
    n, pauses, start, end = len(cum) - 1, speech.pauses, speech.start, speech.end
    m = len(pauses)
    take = np.full(n + 1, np.inf)  # boundary k (1..n-1) follows unit k-1; 0 and n are the edges
    take[1:n] = -np.log(prior)
    skip = np.zeros(n + 1)
    skip[1:n] = -np.log1p(-prior)
    skipped = np.concatenate(([0.0], np.cumsum(skip)))  # skipped[k] = skip[0] + … + skip[k-1]
    inner = np.concatenate(([0.0], np.cumsum([(b - a) / inner_pause_s for a, b in pauses])))
    # Nodes: 0 = the speech start, 1..m = the pauses, m + 1 = the speech end.
    opens = [start] + [b for _, b in pauses]  # where the units after node j begin
    closes = [a for a, _ in pauses] + [end]  # where the units before node j (>= 1) end
    at = start + (end - start) * cum / cum[-1]  # each boundary's time by weight alone
    band = max(_BAND_MIN_S, _BAND_FRACTION * (end - start))
    best = np.full((m + 2, n + 1), np.inf)
    best[0, 0] = 0.0
    back: dict[tuple[int, int], tuple[int, int]] = {}
    for j2 in range(1, m + 2):
        if j2 <= m:
            middle = sum(pauses[j2 - 1]) / 2
            targets = np.flatnonzero(np.abs(at[1:n] - middle) <= band) + 1
        else:
            targets = np.array([n])
        row = np.full(len(targets), np.inf)
        arg = np.zeros((len(targets), 2), dtype=np.int64)
        for j in [0, *range(max(1, j2 - _MAX_SKIPPED - 1), j2)]:
            ks = np.flatnonzero(np.isfinite(best[j]))
            if len(ks) == 0 or len(targets) == 0:
                continue
            expected = rate * (cum[targets][None, :] - cum[ks][:, None])
            cost = (closes[j2 - 1] - opens[j] - expected) ** 2 / (spread * np.maximum(expected, 1e-6))
            cost += best[j, ks][:, None] + skipped[targets][None, :] - skipped[ks + 1][:, None]
            cost += inner[j2 - 1] - inner[j]
            cost[targets[None, :] <= ks[:, None]] = np.inf
            where = np.argmin(cost, axis=0)
            low = cost[where, np.arange(len(targets))]
            better = low < row
            row[better] = low[better]
            arg[better] = np.stack([np.full(int(better.sum()), j), ks[where[better]]], axis=1)
        best[j2, targets] = row + (take[targets] if j2 <= m else 0.0)
        for t, k2 in enumerate(targets.tolist()):
            if np.isfinite(row[t]):
                back[(j2, k2)] = (int(arg[t, 0]), int(arg[t, 1]))
    chosen: list[tuple[int, int]] = []
    node = back[(m + 1, n)]  # the start reaches the end directly, so a path always exists
    while node[0] != 0:
        chosen.append((node[0] - 1, node[1]))
        node = back[node]
    return chosen[::-1]


def snap(spans: list[Span], speech: Speech, reach: list[float]) -> list[Span]:
    """Move each boundary between two touching units to the quietest frame within its ``reach``.

    A word boundary inside running speech is often an energy dip: the closure or the noise of
    the next word's first consonant (nearly every Chinese syllable begins with one). ``reach[i]``
    is for the boundary after unit ``i`` (0: it stays). Neither unit loses more than half its
    length.
    """
    out = list(spans)
    level, frame = speech.level, speech.frame
    for i in range(len(out) - 1):
        (s0, t), (t_next, e1) = out[i], out[i + 1]
        if t != t_next or reach[i] <= 0:
            continue  # a pause lies between: its edges are already where the audio says
        low = max(t - reach[i], t - (t - s0) / 2)
        high = min(t + reach[i], t + (e1 - t) / 2)
        first, last = int(np.ceil(low / frame - 0.5)), int(np.floor(high / frame - 0.5))
        if last < first or first < 0 or last >= len(level):
            continue
        quietest = first + int(np.argmin(level[first : last + 1]))
        here = min(max(int(t / frame), 0), len(level) - 1)
        if level[quietest] > level[here] - _DIP_DB:
            continue  # no dip worth the name (flat or silent audio): the weights decide
        moved = (quietest + 0.5) * frame
        out[i], out[i + 1] = (s0, moved), (moved, e1)
    return out
