"""The cost model of ``python -m bench.gpu_sim``: the device time of one H100, every constant with its source.

Only the device is modelled: :class:`CostModel` prices a token step, a decode, a prefill, a
launch and a read; the engine that charges it is :mod:`bench.gpu_sim.engine`, the clock it
charges :mod:`bench.gpu_sim.clock`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Device time of one H100 (and the host costs that live in the CUDA driver), in seconds.

    Sources (bench/results/gpu/*h200.md, one H200, bf16, the full-size dev model):

    - ``step_base_s`` 2.3 ms: the captured token step at batch 1 took 2.26 ms (2.31 in the
      first check); the step of a 190 M model is launch- and latency-bound, not bandwidth-bound
      (its weights take 0.11 ms to read at an H100's 3.35 TB/s), so an H100 is taken as equal.
    - ``step_row_s`` 4 µs and ``step_position_s`` 26 ns: the H200 step grew 1.02 ms from 1 to
      128 rows at 256 attended positions (8.0 µs a row); an H100 has 0.70× the H200's memory
      bandwidth, and attention reads every attended position's keys and values (60 KiB a
      position for 20 layers, 768 wide, bf16), so 4 µs + 256 × 26 ns = 10.7 µs a row (1.33× the
      H200's). Each row is charged for its own attended positions (split-K attention that reads a
      row only as far as it reaches: issue #43, item 6); padding rows of a graph bucket, 4 µs.
    - ``decode_base_s`` 1 ms and ``decode_row_s`` 0.1 ms: Decoder + Vocos eagerly took 7.6 ms a
      call at 1 row and 13.5 ms at 64 (0.38 and 0.67 ms per token step of a 20-token block):
      0.094 ms a row; captured as a graph, the 250–300 launches of the base (about 3 µs each
      replayed) leave about 1 ms.
    - ``prefill_base_s`` 2.5 ms and ``prefill_token_s`` 1.3 µs: a captured, batched prefill is a
      token step's launch cost plus the prompt tokens' compute (0.38 GFLOP a token at a few
      hundred TFLOP/s); eager it took 20–37 ms a sequence, launch-bound.
    - ``launch_s`` 10 µs: host time of one graph launch or async copy in the CUDA driver
      (``cudaLaunchKernel`` averaged 10 µs on the H200's host); ``read_s`` 50 µs: one host read
      of a quantum's summary and audio from pinned memory after its event (``cudaMemcpyAsync``
      averaged 47 µs). These run in the driver, which this machine has not, so they are charged
      as constants; all other host work is measured.
    - ``row_bucket`` 8: graphs are captured for batch sizes in steps of 8.
    - ``kv_position_bytes`` 60 KiB and ``kv_budget_bytes`` 70 GiB: the H200's 22.85 GiB held 128
      slots × 3120 positions; an 80 GB H100 keeps about 8 GiB for the weights, Decoder + Vocos,
      the graphs and their workspaces.
    """

    step_base_s: float = 2.3e-3
    step_row_s: float = 4e-6
    step_position_s: float = 26e-9
    decode_base_s: float = 1e-3
    decode_row_s: float = 0.1e-3
    prefill_base_s: float = 2.5e-3
    prefill_token_s: float = 1.3e-6
    launch_s: float = 10e-6
    read_s: float = 50e-6
    row_bucket: int = 8
    kv_position_bytes: int = 61_440
    kv_budget_bytes: int = 70 * 2**30

    def step_s(self, positions: list[int]) -> float:
        """One token step over rows attending ``positions`` each, padded to the graph bucket."""
        rows = len(positions)
        padded = -(-rows // self.row_bucket) * self.row_bucket
        return self.step_base_s + padded * self.step_row_s + sum(positions) * self.step_position_s

    def decode_s(self, rows: int) -> float:
        """One captured Decoder + Vocos call over ``rows`` due windows (0: none runs)."""
        return self.decode_base_s + rows * self.decode_row_s if rows else 0.0

    def prefill_s(self, prompts: list[int]) -> float:
        """One batched prefill of the newcomers' prompts (none: nothing runs)."""
        return self.prefill_base_s + sum(prompts) * self.prefill_token_s if prompts else 0.0

    def kv_slots(self, positions_per_slot: int) -> int:
        """KV slots of ``positions_per_slot`` positions that fit the card's KV budget."""
        return self.kv_budget_bytes // (positions_per_slot * self.kv_position_bytes)
