"""``--profile``: one name for the token step's form, instead of a combination of expert flags.

A profile fills in the step flags left at ``auto`` (``--compile-step``, ``--quantize``, and
``--dtype`` under ``exact``); a flag given explicitly (or by its ``CHATTTS_*`` variable) keeps
its value. Which values depends on the device, known only once torch looks at it, so the
engine's loader (:mod:`server.engine.loading`) applies the profile then, and logs one line
naming the profile and every value it set.

* ``realtime`` (the default): the fastest step the device has. On the CPU the token step
  compiled by inductor with int8 weights and activations, built ahead of time
  (``--compile-step ahead --quantize w8a8``; w8a8 only where PyTorch has FBGEMM, x86-64), bf16
  where the CPU computes it natively: one stream in real time on two cores, at the price of a
  compile of minutes at the first start; the graphs are saved in the cache dir and a restart
  loads them in seconds. ``ahead`` rather than ``on``: its graphs are not frozen, and on a quiet
  machine the unfrozen step is as fast as the frozen one (12.7 against 12.5 ms at batch 1, 21.0
  against 20.8 ms at batch 8, full-size model, 2-core EPYC; ``bench/results/cpu/``). Where
  there is no FBGEMM the bf16 step compiles lazily and frozen (``on``): freezing packs its
  projections for oneDNN and cannot be saved. On CUDA, today's CUDA defaults: CUDA graphs in
  fp16/bf16, nothing compiled or quantized.
* ``eager``: the step as loaded, not compiled or quantized (bf16 where native): ready in
  seconds, about 1.5x slower a token than ``realtime`` on a CPU. The test suite runs under it.
* ``exact``: float32, not compiled or quantized: token-identical to ChatTTS's own ``infer()``
  (``tests/model/test_native_equivalence.py``), the slowest.

No ``throughput`` profile: on the CPU the compiled w8a8 step is also the fastest at every
batch (``bench/results/cpu/``), so it would be ``realtime`` again; on CUDA throughput is a
matter of how many streams share a step (``--max-batch 0``: the slots the memory holds), not of
the step's form.

Pure and torch-free, like :mod:`server.engine.flags`: the device type and whether FBGEMM is
there are passed in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

from server.config import PROFILE_CHOICES, Settings


def profile_values(profile: str, device_type: str, *, w8a8_available: bool) -> dict[str, str]:
    """The values ``profile`` gives the step flags on a device of type ``device_type``.

    ``dtype`` is absent where the profile leaves it to ``--dtype auto``'s own rule (bf16 where the
    hardware computes it natively, else float32 on a CPU and fp16 on a GPU).
    """
    if profile not in PROFILE_CHOICES:
        raise ValueError(f"--profile {profile!r}: must be one of {', '.join(PROFILE_CHOICES)}")
    if profile == "exact":
        return {"compile_step": "off", "quantize": "none", "dtype": "float32"}
    if profile == "eager" or device_type != "cpu":  # CUDA: its graphs are its fast step already
        return {"compile_step": "off", "quantize": "none"}
    if w8a8_available:  # built ahead of time: a restart loads the graphs instead of tracing them
        return {"compile_step": "ahead", "quantize": "w8a8"}
    return {"compile_step": "on", "quantize": "none"}  # bf16's frozen graphs cannot be saved


@dataclass(frozen=True)
class Profiled:
    """``settings`` with the profile applied, and what it set (for the start-up log)."""

    settings: Settings
    profile: str
    device_type: str
    chosen: dict[str, str]
    """The flags the profile set, by field name: those that were ``auto``."""
    kept: dict[str, str]
    """The flags given explicitly, which the profile would have set otherwise."""

    def log_line(self) -> str:
        """One line: the profile, the device, every value it set and every explicit flag that won."""
        chosen = ", ".join(f"{_flag(name)} {value}" for name, value in self.chosen.items()) or "nothing"
        line = f"profile {self.profile} on {self.device_type}: set {chosen}"
        if self.settings.dtype == "auto":
            line += " (--dtype auto: bf16 where the hardware computes it natively)"
        if self.kept:
            line += "; kept as given: " + ", ".join(f"{_flag(n)} {v}" for n, v in self.kept.items())
        return line


def apply_profile(settings: Settings, device_type: str, *, w8a8_available: bool) -> Profiled:
    """The settings the engine runs with: each step flag still at ``auto`` takes the profile's value.

    Raises:
        ValueError: an unknown profile, named.
    """
    values = profile_values(settings.profile, device_type, w8a8_available=w8a8_available)
    if values.get("compile_step") == "ahead" and settings.quantize not in ("auto", "w8a8"):
        values["compile_step"] = "on"  # only the w8a8 step keeps its speed unfrozen (see the module)
    chosen = {name: value for name, value in values.items() if getattr(settings, name) == "auto"}
    kept = {name: getattr(settings, name) for name in values if name not in chosen}
    return Profiled(
        settings=dataclasses.replace(settings, **cast(dict[str, Any], chosen)),  # str fields only
        profile=settings.profile,
        device_type=device_type,
        chosen=chosen,
        kept=kept,
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
