"""Choosing and constructing the ChatTTS engine from settings (no torch import here).

Kept apart from ``engine/chattts.py`` so that the server can be configured,
and its errors reported, without importing torch.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from server.config import Settings
from server.engine.flags import engine_options, inherited_wait_policy, parse_cpus, thread_environment
from server.engine.profiles import apply_profile
from server.engine.weights.locate import cache_root, hub_cache, locate
from server.errors import StartupError

if TYPE_CHECKING:
    from server.engine_api import Engine

log = logging.getLogger(__name__)


class ModelUnavailable(StartupError):
    """The model cannot be loaded; the one-line message says what to do."""


def _available_cpus() -> frozenset[int]:
    """The CPUs this thread may run on (all of them where the platform cannot pin threads)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def prepare_threads(settings: Settings) -> None:
    """Set what torch's threads read when torch loads (``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``): not later."""
    inherited = inherited_wait_policy(settings)
    if inherited is not None:
        costly, message = inherited
        log.log(logging.WARNING if costly else logging.INFO, "%s", message)
    wanted = thread_environment(settings)
    if not wanted:
        return
    if "torch" in sys.modules:  # libgomp read its environment when torch was imported
        level = logging.DEBUG if settings.omp_wait_policy == "auto" else logging.WARNING
        log.log(level, "torch was loaded before the server could set %s: not applied", wanted)
        return
    os.environ.update(wanted)


def chattts_engine_factory(settings: Settings) -> Callable[[], Engine]:
    """A constructor for the ChatTTS engine described by ``settings`` (runs on the inference thread).

    Raises:
        ModelUnavailable: at once, for an engine flag out of range (the message names it).
    """
    try:
        engine_options(settings)  # every engine flag checked, named, before anything loads
        cpus = parse_cpus(settings.engine_cpus, _available_cpus())
        if cpus and not hasattr(os, "sched_setaffinity"):
            raise ValueError(f"--engine-cpus {settings.engine_cpus!r}: this platform cannot pin threads")
    except ValueError as exc:
        raise ModelUnavailable(str(exc)) from None
    if cpus:  # this (the event loop's) thread, and every thread it starts later, keeps off them
        os.sched_setaffinity(0, _available_cpus() - cpus)

    def build() -> Engine:
        if cpus:  # the inference thread; torch's threads, started from it, inherit its CPUs
            os.sched_setaffinity(0, cpus)
        prepare_threads(settings)
        from server.engine.chattts.assets import ModelUnavailableError
        from server.engine.chattts.devmodel import make_dev_model
        from server.engine.chattts.engine import ChatTTSEngine
        from server.engine.chattts.step.decode_attention import server_build_root

        chosen = profiled(settings)  # the step flags the profile sets need the device

        # The compiled step's C++ attention is built once into the cache dir (a volume), not ~/.cache.
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(server_build_root(cache_root(settings))))

        # The same answer as `chattts-stream weights where`; the hub cache's snapshot is found (or
        # downloaded) by the loader, so only a folder named by a flag is taken from here.
        model_dir = locate(settings, look_in_cache=False).folder
        if settings.dev_model and model_dir is not None and not (model_dir / "DEV_MODEL.json").is_file():
            log.warning("writing a random-weight %s dev model to %s", settings.dev_model, model_dir)
            make_dev_model("full" if settings.dev_model == "full" else "tiny", model_dir)
        try:
            engine = ChatTTSEngine.load(
                model_dir=model_dir,
                device=settings.device,
                dtype=chosen.dtype,
                num_threads=settings.threads or None,
                cache_dir=hub_cache(settings),
                verify_weights="none" if settings.verify_weights == "none" else "official",
                options=engine_options(chosen),
            )
        except ModelUnavailableError as exc:
            raise ModelUnavailable(_naming_the_flag(str(exc), settings)) from None
        except Exception as exc:  # a broken file, a device that is not there: one line, not a traceback
            cause = f"{type(exc).__name__}: {exc}"
            raise ModelUnavailable(_naming_the_flag(f"the model failed to load: {cause}", settings)) from None
        if engine.random_weights:
            log.warning("SERVING RANDOM WEIGHTS from %s: the audio is noise, not speech", model_dir)
        return engine

    return build


def profiled(settings: Settings) -> Settings:
    """``settings`` with ``--profile`` applied for the device it names, logged in one line.

    Imports torch (the device, FBGEMM): call it where the engine is built.

    Raises:
        ModelUnavailable: a ``--device`` torch cannot parse.
    """
    from server.engine.chattts.setup import resolve_device
    from server.engine.chattts.step.w8a8 import quantized_engine_available

    try:
        device_type = resolve_device(settings.device).type
    except (RuntimeError, ValueError) as exc:
        raise ModelUnavailable(f"--device {settings.device!r}: {exc}") from None
    applied = apply_profile(settings, device_type, w8a8_available=quantized_engine_available())
    log.info("%s", applied.log_line())
    return applied.settings


def _naming_the_flag(message: str, settings: Settings) -> str:
    """``message`` on one line, naming the flag to change when it does not already."""
    line = " ".join(message.split())
    if "--" in line:
        return line
    flag = "--dev-model" if settings.dev_model else "--model-dir" if settings.model_dir else "--cache-dir"
    return f"{line} (check {flag}, --device, --dtype)"
