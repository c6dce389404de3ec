"""The soak's fd check: a leaked descriptor fails it, one still closing at a sample does not."""

from __future__ import annotations

from bench.harness.sampler import Sample
from bench.soak.report import analyse_samples


def _samples(before: list[int], after: list[int]) -> list[Sample]:
    def sample(t: float, phase: str, fds: int) -> Sample:
        return Sample(t=t, phase=phase, rss_bytes=100 << 20, fds=fds, threads=8, cpu_s=0.0, requests_done=0)

    samples = [sample(-1.0 + i * 0.1, "idle_before", n) for i, n in enumerate(before)]
    samples += [sample(float(t), "load", 30) for t in range(10)]
    samples += [sample(20.0 + i * 0.1, "idle_after", n) for i, n in enumerate(after)]
    return samples


def test_a_descriptor_left_open_after_the_load_is_growth() -> None:
    fds = analyse_samples(_samples([17, 17, 17], [18, 18, 18]), 0.0, 9.0)["fds"]
    assert fds["growth_idle"] == 1


def test_a_socket_closing_at_one_idle_sample_is_not_growth() -> None:
    # The loaded-machine flake: idle 17 before, one sample of 18 after (the sampler's own
    # /metrics request still closing), then 17 again.
    fds = analyse_samples(_samples([17, 17, 17], [17, 18, 17]), 0.0, 9.0)["fds"]
    assert fds["growth_idle"] == 0
    # ... and a transient before the load does not hide a leak after it.
    fds = analyse_samples(_samples([17, 19, 17], [18, 18, 18]), 0.0, 9.0)["fds"]
    assert fds["growth_idle"] == 1
