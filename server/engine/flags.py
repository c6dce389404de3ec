"""From the engine's flags to what the engine runs with: its options, torch's threads, CPU pinning.

Pure and torch-free, like :mod:`server.config`, so that a bad flag is reported in one line
before anything heavy loads; :mod:`server.engine.loading` applies the results.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from server.config import OPENMP_VARIABLES, Settings
from server.engine.chattts.options import EngineOptions
from server.engine.weights.locate import cache_root


def thread_environment(settings: Settings, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set before torch loads (``env``: default the process's).

    ``auto`` keeps what the environment sets, else asks for a short spin: an idle thread catches
    the step's next small operator instead of sleeping in the kernel (PASSIVE: 30.1 against 16.9
    ms per step at batch 1 on two EPYC cores); ``passive`` also zeroes libgomp's spin count.
    """
    env = os.environ if env is None else env
    if settings.omp_wait_policy == "auto":
        if any(name in env for name in OPENMP_VARIABLES):
            return {}
        return {"GOMP_SPINCOUNT": str(settings.omp_spin_count)}
    if settings.omp_wait_policy == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    return {"OMP_WAIT_POLICY": settings.omp_wait_policy.upper()}


def inherited_wait_policy(
    settings: Settings, env: Mapping[str, str] | None = None
) -> tuple[bool, str] | None:
    """What to log when ``--omp-wait-policy auto`` keeps an inherited OpenMP wait (``None``: none inherited).

    ``(costly, message)``: costly when the inherited setting makes idle threads sleep at once
    (``OMP_WAIT_POLICY=PASSIVE`` without a spin count, or ``GOMP_SPINCOUNT=0``), which on a CPU of
    the server's own makes every token step slower: a warning, with the flag that overrides it.
    An explicit ``--omp-wait-policy`` overrides what was inherited, so it has nothing to report.
    """
    env = os.environ if env is None else env
    inherited = {name: env[name] for name in OPENMP_VARIABLES if name in env}
    if settings.omp_wait_policy != "auto" or not inherited:
        return None
    given = " ".join(f"{name}={value}" for name, value in inherited.items())
    spin = inherited.get("GOMP_SPINCOUNT")
    sleeps = spin == "0" or (spin is None and inherited.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE")
    if not sleeps:
        return False, f"OpenMP wait from the environment kept ({given}); --omp-wait-policy overrides it"
    return True, (
        f"OpenMP threads sleep at once ({given}, inherited from the environment, kept by "
        "--omp-wait-policy auto): on a CPU of its own the token step is up to 1.8x slower (30.1 against "
        "16.9 ms at batch 1 on two EPYC cores; one stream's RTF 2.5 against 1.3 in issue #46). Right "
        "beside other busy processes; otherwise pass --omp-wait-policy active (or unset it)"
    )


def compiled_root(settings: Settings) -> Path:
    """Where the compiled CPU step's artifacts live: ``<cache dir>/compiled`` (a volume in the images)."""
    return cache_root(settings) / "compiled"


def parse_cpus(text: str, available: frozenset[int]) -> frozenset[int]:
    """``"1"`` or ``"0,2-3"`` → those CPU numbers, each one of ``available``; ``""`` → none (no pinning).

    Raises:
        ValueError: naming ``--engine-cpus``.
    """
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"--engine-cpus {text!r}: expected CPU numbers such as 1 or 0,2-3") from None
    if not cpus <= available:
        have = ",".join(map(str, sorted(available)))
        raise ValueError(f"--engine-cpus {text!r}: this process may run on CPUs {have} only")
    if cpus == available and len(available) > 1:
        raise ValueError(
            f"--engine-cpus {text!r}: leave at least one CPU to the event loop (or leave it empty)"
        )
    return frozenset(cpus)


def parse_block_schedule(text: str) -> tuple[int, ...]:
    """``"8,16,32"`` → ``(8, 16, 32)``; every entry must be a positive integer.

    Raises:
        ValueError: naming ``--block-schedule``.
    """
    try:
        blocks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--block-schedule {text!r}: expected integers such as 8,16,32") from None
    if not blocks or min(blocks) < 1:
        raise ValueError(f"--block-schedule {text!r}: every block must be at least 1 token")
    return blocks


def engine_options(settings: Settings) -> EngineOptions:
    """The ChatTTS engine's options from the flags (those it has no flag for keep their defaults).

    ``settings`` should have its profile applied (:func:`server.engine.profiles.apply_profile`,
    which needs the device); a step flag still at ``auto`` counts as off here, which is enough to
    check the other flags before anything loads.

    Raises:
        ValueError: one line naming the flag to change.
    """
    from server.voices.recording import transcript_limit  # soundfile: only when an engine is built

    blocks = parse_block_schedule(settings.block_schedule)
    if settings.quantum_tokens < 0 or (
        settings.quantum_tokens and any(block % settings.quantum_tokens for block in blocks)
    ):
        raise ValueError(
            f"--quantum-tokens {settings.quantum_tokens}: must be 0 (the device's default) or divide "
            f"every block of --block-schedule {settings.block_schedule}"
        )
    if settings.prefill_bucket < 1:
        raise ValueError(f"--prefill-bucket {settings.prefill_bucket}: must be at least 1 (1: off)")
    if settings.segment_max_tokens < 1:
        raise ValueError(f"--segment-max-tokens {settings.segment_max_tokens}: must be at least 1")
    if settings.max_batch < 0:
        raise ValueError(f"--max-batch {settings.max_batch}: must be 0 (sized to the device) or more")
    if settings.refine_max_tokens < 0:
        raise ValueError(f"--refine-max-tokens {settings.refine_max_tokens}: must be 0 (off) or more")
    if settings.omp_spin_count < 0:
        raise ValueError(f"--omp-spin-count {settings.omp_spin_count}: must be 0 (sleep at once) or more")
    return EngineOptions(
        block_schedule=blocks,
        quantum_tokens=settings.quantum_tokens or None,
        overlap_quanta=None if settings.overlap_quanta == "auto" else settings.overlap_quanta == "on",
        prefill_bucket=settings.prefill_bucket,
        warmup_prompt_chars=settings.segment_max_chars,
        max_batch=settings.max_batch or None,
        segment_max_tokens=settings.segment_max_tokens,
        cuda_graphs=settings.cuda_graphs == "on",
        compile_step=settings.compile_step in ("on", "ahead"),
        compile_ahead=settings.compile_step == "ahead",
        compile_cache_dir=str(compiled_root(settings)),
        quantize="none" if settings.quantize == "auto" else settings.quantize,
        vocoder_dtype=settings.vocoder_dtype,
        refine_max_tokens=settings.refine_max_tokens,
        voice_max_seconds=settings.voice_max_seconds,
        voice_transcript_tokens=transcript_limit(settings.voice_max_seconds),
    )
