"""``chattts-stream compile``: build the compiled CPU step's artifacts ahead of time.

``serve`` with ``--compile-step on`` compiles the token step at warm-up and keeps what inductor
built in ``<cache dir>/compiled`` (:mod:`server.engine.chattts.step.compile_cache`); with
``--compile-step ahead`` it saves the step's graphs there too, which a restart loads without
tracing (:mod:`server.engine.chattts.step.aot`). The folder is keyed by
torch, the CPU, the model, the step's form and its code. This command loads the engine with the same flags
(every ``serve`` flag and ``CHATTTS_*`` variable applies) and compiles, so that a server
started afterwards, in an image built with it or after an init container ran it, finds its
folder warm. Run it on the machine (or the same kind of CPU) that serves: another CPU is
another key, and the server compiles again rather than load a foreign artifact.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping
from typing import Any

from server.config import add_settings_arguments, settings_from_namespace
from server.engine.flags import compiled_root
from server.engine.profiles import profile_values
from server.errors import StartupError


def add_compile_command(commands: Any, env: Mapping[str, str]) -> None:
    """Add ``compile`` to the ``chattts-stream`` subcommands (``commands``: argparse's subparsers)."""
    parser = commands.add_parser(
        "compile",
        help="compile the CPU token step ahead of time into the cache dir (for images, init containers)",
        usage="%(prog)s [FLAG ...]",
        description="Load the engine with serve's flags (--profile realtime, the default, or "
        "--compile-step on, and the --quantize, --dtype, --max-batch and model flags serve will run "
        "with) and compile its token step into <cache dir>/compiled, where serve with the same flags "
        "on this kind of machine finds it. "
        "Exits 0 when the step compiled, 1 when it fell back to the eager step, 2 for a flag error.",
    )
    add_settings_arguments(parser, env)


def run_compile(args: argparse.Namespace) -> int:
    """The ``compile`` subcommand; the exit status."""
    settings = settings_from_namespace(args)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    step = settings.compile_step
    if step == "auto":  # as the profile sets it on a CPU, the only device whose step compiles
        step = profile_values(settings.profile, "cpu", w8a8_available=True)["compile_step"]
    if step not in ("on", "ahead"):
        print(
            "chattts-stream compile: nothing to compile: the step compiles under --profile realtime "
            "(the default) or --compile-step on or ahead (CHATTTS_COMPILE_STEP=on)"
        )
        return 2
    if settings.engine != "chattts":
        print(f"chattts-stream compile: --engine {settings.engine} has no step to compile")
        return 2
    from server.engine.loading import chattts_engine_factory

    began = time.perf_counter()
    try:
        engine = chattts_engine_factory(settings)()  # loading the engine compiles its step
    except StartupError as exc:
        print("chattts-stream compile: " + " ".join(str(exc).splitlines()))
        return 2
    try:
        facts = engine.info.extra
        if facts.get("token_step") != "compiled":
            print(f"chattts-stream compile: the step did not compile: {facts.get('token_step_fallback')}")
            return 1
        seconds = time.perf_counter() - began
        print(f"compiled the token step into {compiled_root(settings)} in {seconds:.0f} s")
        return 0
    finally:
        engine.close()
