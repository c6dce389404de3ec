"""The ``chattts-stream`` command: ``serve``, ``make-dev-model``, ``weights`` and ``compile``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from server.config import Settings, add_settings_arguments, settings_from_namespace
from server.engine.compile_command import add_compile_command, run_compile
from server.engine.weights.command import add_weights_command, run_weights


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chattts-stream",
        description="Real-time streaming text-to-speech server for ChatTTS (WebSocket protocol v1).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the server",
        # The flags are listed by topic below; argparse's usage line would list all ninety again.
        usage="%(prog)s [FLAG ...]",
        description="Run the server. Its flags are grouped by topic below; every flag can also be set "
        "with the CHATTTS_* environment variable shown in its help (a flag wins over the variable). "
        "The operator's manual (docs/operations.md) says which ones matter on a GPU, on a CPU and "
        "in Kubernetes.",
    )
    add_settings_arguments(serve, os.environ)
    dev = commands.add_parser(
        "make-dev-model",
        help="write random ChatTTS weights (for tests, benchmarks and trying the server offline)",
        description="Write random-weight ChatTTS assets in ChatTTS's exact file layout. "
        "They produce noise, not speech; serve them with --model-dir DIR (the folder's "
        "DEV_MODEL.json marks them as random weights: they are checked against its hashes).",
    )
    dev.add_argument(
        "--size", choices=("tiny", "full"), default="tiny", help="tiny: tests/CI; full: real shapes"
    )
    dev.add_argument("--seed", type=int, default=0, help="random seed for the weights")
    dev.add_argument("directory", type=Path, help="folder to write (created if missing)")
    add_weights_command(commands, os.environ)
    add_compile_command(commands, os.environ)
    return parser


def _role(settings: Settings) -> str:
    """The log lines' prefix under ``--frontend-processes N``: which process wrote them."""
    if settings.frontend_processes > 1:
        return "supervisor "
    return f"front-end {os.getpid()} " if settings.engine_socket else ""


#: ``--frontend-priority lower``: the front-end children's nice increment over the engine's.
LOWER_NICE = 10


def _lower_priority(choice: str) -> None:
    """This process's CPU priority below the engine process's (``--frontend-priority``).

    Called before any thread starts: Linux keeps a priority per thread, and every thread this
    process will have (event loop, encoder pool, torch's) inherits it from the main thread.
    ``idle`` is ``SCHED_IDLE``: the scheduler runs these threads only on a core nothing else
    wants, and a waking engine thread preempts them at once, where a nice value still lets the
    running thread finish its slice (``bench/results/studies/frontend-priority-<hw>.md``).
    """
    if choice in ("lower", "auto"):  # auto: the supervisor resolves it; a child started by hand
        os.nice(LOWER_NICE)
    elif choice == "idle":
        if hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:  # not Linux: the lowest nice value is the nearest there is
            os.nice(19)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``chattts-stream`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "weights":
        return run_weights(args)
    if args.command == "compile":
        return run_compile(args)
    if args.command == "make-dev-model":
        from server.engine.chattts.devmodel import make_dev_model

        make_dev_model(args.size, args.directory, seed=args.seed)
        print(f"wrote a random-weight {args.size} ChatTTS model to {args.directory}")
        return 0
    settings = settings_from_namespace(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {_role(settings)}%(name)s: %(message)s",
    )
    # websockets logs every HTTP probe at INFO; health checks would flood the log.
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.getLogger().level))
    if settings.frontend_processes < 1:
        print("chattts-stream: --frontend-processes must be 1 or more", file=sys.stderr)
        return 2
    if settings.frontend_processes > 1:
        from server.supervisor import supervise

        return supervise(settings, list(sys.argv[1:] if argv is None else argv))
    if settings.engine_socket:  # a front-end child of the supervisor
        _lower_priority(settings.frontend_priority)
    import uvloop

    from server.app import App
    from server.errors import StartupError

    try:
        uvloop.run(App(settings).run_until_signalled())
    except StartupError as exc:  # App.start has stopped everything it started: no thread is left
        print("chattts-stream: " + " ".join(str(exc).splitlines()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
