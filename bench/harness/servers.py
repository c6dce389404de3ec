"""Starting and stopping server subprocesses for a run (free port, wait for ``/ready``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from tests.serverproc import free_port  # one port picker for tests and benchmarks

#: ``python -m server serve`` from the repository that holds ``bench/``.
REPO_ROOT = Path(__file__).resolve().parents[2]


def http_status(url: str, timeout_s: float = 5.0) -> int:
    """HTTP status of ``GET url`` (errors as their status; raises ``OSError`` when unreachable)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


def scrape_metrics(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """``GET url`` (a ``/metrics`` page): every unlabelled sample by name (histogram sums and counts)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    return {
        sample.name: float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def engine_thread_figures(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, Any]:
    """What the inference thread did between two scrapes ``wall_s`` apart.

    ``engine_busy``: the share of the wall time inside engine steps (near 1: the engine is the
    limit; well below: the thread waited for work, the policy or the hand-off);
    ``tokens_per_block``: token steps per engine step (short blocks: newcomers and cancels
    end blocks early, and per-block work weighs more); ``rows_per_step``: the mean batch;
    ``step_ms_per_token``: the step's wall time per token step (a block of 32 tokens is 32
    token steps): the same figure as the engine's in-process, so a server whose step is slower
    than its engine's loses to CPU contention inside the step, and one whose step is as fast
    loses outside it (prefills, the policy, waiting).
    """

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("chattts_block_seconds_count")  # every step observes all three histograms once
    # None where the server has no block-tokens histogram (one from before it existed).
    token_steps = delta("chattts_block_tokens_sum") if "chattts_block_tokens_sum" in after else None
    return {
        "engine_steps": int(steps),
        "engine_busy": round(delta("chattts_block_seconds_sum") / wall_s, 3) if wall_s > 0 else None,
        "tokens_per_block": round(token_steps / steps, 2) if steps and token_steps is not None else None,
        "rows_per_step": round(delta("chattts_batch_size_sum") / steps, 2) if steps else None,
        "step_ms_per_token": round(1000 * delta("chattts_block_seconds_sum") / token_steps, 2)
        if token_steps
        else None,
    }


def open_log(path: Path | None) -> IO[bytes] | int:
    """An append-mode log file for a child process, or ``DEVNULL``."""
    return open(path, "ab") if path else asyncio.subprocess.DEVNULL


#: Environment overrides for every process the harness starts (set by the CLI).
CHILD_ENV: dict[str, str] = {}


def child_env() -> dict[str, str]:
    """The environment of a started server or baseline: ours plus :data:`CHILD_ENV`, unbuffered."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **CHILD_ENV}


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process and of the processes it started, else ``None``.

    A server with ``--engine-process`` runs its engine in a child: its CPU counts as the
    server's (Linux ``/proc``; a child that ended and was waited for is in ``cutime``/``cstime``).
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    own = (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / ticks
    return own + sum(process_cpu_s(child) or 0.0 for child in _children(pid))


def _children(pid: int) -> list[int]:
    """The live processes ``pid`` started (``/proc/PID/task/*/children``)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(child) for child in (task / "children").read_text().split()]
    return found


class ServerProcess:
    """One ``serve`` subprocess on a free loopback port.

    Args:
        flags: ``serve`` flags besides ``--host``/``--port`` (e.g. ``--engine fake``).
        command: the command prefix that runs ``serve`` (default
            ``python -m server serve`` in this repository).
        log_path: where the server's stdout/stderr go.
        cwd: working directory (default: the repository root).
        env: the server's whole environment (default: :func:`child_env`).
    """

    def __init__(
        self,
        flags: list[str],
        *,
        command: list[str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.flags = list(flags)
        self.env = env
        self.command = command or [sys.executable, "-m", "server", "serve"]
        self.log_path = log_path
        self.cwd = cwd or REPO_ROOT
        self.port = free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.ready_s: float | None = None

    @property
    def argv(self) -> list[str]:
        """The full command line."""
        return [*self.command, "--host", "127.0.0.1", "--port", str(self.port), *self.flags]

    @property
    def url(self) -> str:
        """The WebSocket endpoint."""
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def describe(self) -> dict[str, Any]:
        """For the results: the command line (shell-quoted), flags and start-up time."""
        return {"command": shlex.join(self.argv), "flags": self.flags, "ready_s": self.ready_s}

    def cpu_s(self) -> float | None:
        """CPU seconds the server used so far."""
        return (
            process_cpu_s(self.proc.pid) if self.proc is not None and self.proc.returncode is None else None
        )

    async def start(self, timeout_s: float = 600.0) -> None:
        """Start the process and wait until ``/ready`` answers 200.

        Raises:
            RuntimeError: the server exited or did not become ready in time.
        """
        began = time.perf_counter()
        log = open_log(self.log_path)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                cwd=self.cwd,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env if self.env is not None else child_env(),
            )
        finally:
            if not isinstance(log, int):
                log.close()
        ready_url = f"http://127.0.0.1:{self.port}/ready"
        deadline = began + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.returncode is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up: {shlex.join(self.argv)}"
                )
            try:
                if await asyncio.to_thread(http_status, ready_url, 2.0) == 200:
                    self.ready_s = time.perf_counter() - began
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        await self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s: {shlex.join(self.argv)}")

    async def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return proc.returncode if proc else None
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                return await proc.wait()
        except TimeoutError:
            proc.kill()
            return await proc.wait()
