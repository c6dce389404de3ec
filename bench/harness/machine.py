"""A description of the machine and software a run measured (stored in every result)."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


#: Where committed results live: one current result per question and hardware (its README indexes them).
RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"
#: CPU families named in result files, by a word of the CPU's model name.
_FAMILIES = ("epyc", "xeon", "ryzen", "threadripper", "core", "graviton", "neoverse")


def hardware_name(model: str | None = None, cores: int | None = None) -> str:
    """This CPU as ``bench/results`` names it: its family and core count, e.g. ``xeon-2core``.

    A GPU result is named by its GPU instead (``bench.gpu``: ``h200``).
    """
    model = (model if model is not None else _cpu_model()).lower()
    words = re.findall(r"[a-z0-9]+", model.replace("(r)", " ").replace("(tm)", " "))
    family = next((w for w in words if w in _FAMILIES), words[0] if words else "cpu")
    return f"{family}-{cores or os.cpu_count() or 1}core"


def result_stem(folder: str, question: str = "") -> Path:
    """``bench/results/<folder>/<question>-<hardware>`` (no suffix): where a rerun here overwrites."""
    name = f"{question}-{hardware_name()}" if question else hardware_name()
    return RESULTS_DIR / folder / name


def write_result(stem: Path, command: str, results: dict[str, Any], markdown: str) -> None:
    """``stem``.json (the command, this machine, the results) and ``stem``.md; prints the markdown."""
    stem.with_suffix(".json").write_text(
        json.dumps({"command": command, "machine": describe_machine(), **results}, indent=1) + "\n"
    )
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)


def describe_machine() -> dict[str, Any]:
    """CPU model and cores, memory, GPUs (when ``nvidia-smi`` exists), OS, package versions."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
        "platform": platform.platform(),
        "loadavg_at_start": list(load) if load else None,
        "git_commit": _git_commit(),
        "versions": {
            "python": sys.version.split()[0],
            **{
                name: _version(name)
                for name in (
                    "torch",
                    "websockets",
                    "numpy",
                    "opuslib",
                    "chattts",
                    "transformers",
                    "matplotlib",
                )
            },
        },
    }
