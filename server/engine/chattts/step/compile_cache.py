"""Where the compiled CPU step's artifacts are kept across restarts, and when they may be used.

The compiled step's graphs, saved ahead of time (:mod:`.aot`), and what inductor compiled for
them (the generated C++ and its libraries: its FX-graph cache, ``TORCHINDUCTOR_CACHE_DIR``, by
default a folder in ``/tmp`` that a container loses on every restart) are kept in the server's
cache dir (``--cache-dir``, ``CHATTTS_CACHE_DIR``; ``/models`` in the images, a volume), in one
folder per **key**: a hash of everything the generated code depends on (:func:`step_facts`):
torch's and Python's versions, the CPU's instruction sets (inductor writes AVX-512 or AVX2 code
for the CPU it runs on), the GPT's weights file, the step's form (dtype, quantization, its
bucket shapes), and the code the graph is traced from: transformers' version (its Llama layers)
and a digest of this package's own sources (:func:`step_code_digest`), so that an edited step,
or a deploy of a new commit, never meets the artifact of the old one. Another torch, another
CPU, another model or another step therefore looks in another folder: a stale or foreign
artifact is rebuilt, never loaded.

A folder is **sealed** after a compile succeeded: ``manifest.json`` holds the facts and the
SHA-256 of every file. Opening a folder checks both; a folder that is not sealed (a compile was
killed), whose facts differ (copied from elsewhere) or whose files changed (a disk error, a
truncated copy) is removed, with one log line, and the step is compiled afresh. An ``flock``
keeps two processes sharing the volume from compiling into one folder at once.

What a warm folder saves, measured (``docs/operations.md``, "Run on a CPU"). Under
``--compile-step ahead``, everything the first start did for the step: a restart loads the
saved graphs (``aot/*.pt``) in seconds and runs warm-up through them, with no dynamo tracing,
AOTAutograd or inductor; loading writes nothing into the folder, so the seal holds. Under
``--compile-step on`` (lazily, frozen), only inductor's C++ compile and link of every graph
(the FX-graph cache hits 2 of 2): dynamo's tracing, AOTAutograd's and the freezing passes run
at every start, since AOTAutograd's own cache refuses a frozen graph ("Cannot cache a graph
with freezing enabled"), about 166 of a restart's 189 s on two cores; and nothing for the bf16
compiled step (``--quantize none``), whose oneDNN-packed weights make inductor's FX-graph
cache bypass the graph (neither hit nor miss counted).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import transformers

from server.engine.chattts.step import cpu
from server.engine.chattts.step.w8a8 import w8a8_kernel

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: The GPT's files under ``asset/gpt/`` (ChatTTS's layout): the model the step is compiled from.
GPT_FILES = ("config.json", "model.safetensors")
#: /proc/cpuinfo flags whose presence changes the code inductor or FBGEMM generate.
CPU_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "bmi", "vnni")
#: The step package: the code dynamo traces the compiled graph from (and the C++ attention's source).
STEP_PACKAGE = Path(__file__).resolve().parent
#: Inductor's lock files (``locks/*.lock``, written as it runs) and the manifest: not artifacts.
_NOT_ARTIFACTS = {"locks", MANIFEST, f"{MANIFEST}.tmp"}


def cpu_flags(cpuinfo: str | None = None) -> str:
    """The CPU's instruction-set flags that matter to generated code, sorted, space-separated."""
    found = cpu.flags() if cpuinfo is None else cpu.parse_flags(cpuinfo)
    if found is None:  # not Linux: the machine's name stands for its features
        return platform.machine()
    return " ".join(sorted(f for f in found if f.startswith(CPU_FLAG_PREFIXES)))


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file, read in blocks."""
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def machine_facts() -> dict[str, str]:
    """What the generated code depends on in this process: torch, Python, the CPU."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "cpu_flags": cpu_flags(),
    }


def model_digest(model_dir: Path) -> str:
    """One digest of the GPT's config and weights (``asset/gpt/``): what the compiled step computes with."""
    parts = [f"{name}={file_digest(model_dir / 'asset' / 'gpt' / name)}" for name in GPT_FILES]
    return "sha256:" + hashlib.sha256(" ".join(parts).encode()).hexdigest()


def step_code_digest(package: Path = STEP_PACKAGE) -> str:
    """One digest of the step package's sources (``*.py`` and ``csrc/``), names and bytes.

    The whole package rather than the modules a graph happens to trace today: a file left out
    would be the one whose edit loads an old graph. Editing a docstring here costs one compile.
    """
    digest = hashlib.sha256()
    sources = sorted([*package.glob("*.py"), *(p for p in package.glob("csrc/*") if p.is_file())])
    for path in sources:
        digest.update(f"{path.relative_to(package)}\0{file_digest(path)}\0".encode())
    return "sha256:" + digest.hexdigest()


def step_facts(*, model_dir: Path, dtype: torch.dtype, quantize: str) -> dict[str, str]:
    """The key's facts for one engine: the machine's, the GPT's weights, the step's form and code.

    For w8a8 the form includes the products' kernel (:func:`~.w8a8.w8a8_kernel`): a CPU with
    AVX512-VNNI where this process could not build the kernel uses FBGEMM under the same other facts.

    The bucket shapes are added by the runner, which knows them (:meth:`CompiledRunner.prepare`).
    """
    facts = {
        **machine_facts(),
        "model": model_digest(model_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "quantize": quantize,
        "transformers": transformers.__version__,
        "step_code": step_code_digest(),
    }
    if quantize == "w8a8":  # a graph calls one kernel's operator on that kernel's weights
        facts["w8a8_kernel"] = w8a8_kernel()
    return facts


def compile_key(facts: Mapping[str, str]) -> str:
    """The folder name for ``facts``: 16 hex digits of their SHA-256 (any fact changed, another name)."""
    text = json.dumps(dict(facts), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _artifacts(folder: Path) -> dict[str, str]:
    """Every artifact file under ``folder`` (relative path → digest), the manifest and locks left out."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or _NOT_ARTIFACTS & set(relative.parts) or path.suffix == ".lock":
            continue
        found[str(relative)] = file_digest(path)
    return found


class CompileCache:
    """The keyed folders under ``root`` (``<cache dir>/compiled``).

    Args:
        root: the parent of every key's folder (created when first used).
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, facts: Mapping[str, str]) -> Path:
        """The folder of ``facts``' key."""
        return self.root / compile_key(facts)

    @contextlib.contextmanager
    def open(self, facts: Mapping[str, str]) -> Iterator[Path]:
        """Hold the key's folder (exclusively), checked, with inductor's cache pointed into it.

        Yields the folder; a folder that fails its check was emptied first (logged once).
        The caller compiles inside the block, then calls :meth:`seal`.
        """
        folder = self.folder(facts)
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
            try:
                problem = self.check(folder, facts)
                if problem is not None:
                    if folder.exists():
                        log.warning("compiled step in %s refused (%s): compiling afresh", folder, problem)
                        shutil.rmtree(folder)
                    folder.mkdir(parents=True)
                with _environment(TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor")):
                    yield folder
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def check(folder: Path, facts: Mapping[str, str]) -> str | None:
        """Why ``folder`` may not be used for ``facts`` (``None``: it may)."""
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            return "not sealed: no compile finished in it" if folder.exists() else "empty"
        except (OSError, ValueError) as exc:
            return f"unreadable manifest: {exc}"
        if not isinstance(manifest, dict) or manifest.get("facts") != dict(facts):
            return "built for another torch, CPU, model or step form"
        sealed, found = manifest.get("files"), _artifacts(folder)
        if sealed != found:
            sealed = sealed if isinstance(sealed, dict) else {}
            differ = sorted(set(sealed.items()) ^ set(found.items()))
            return f"its files differ from those sealed: {differ[0][0]}" if differ else "bad file list"
        return None

    @staticmethod
    def seal(folder: Path, facts: Mapping[str, str]) -> None:
        """Record ``facts`` and every file's digest: the folder may be used from now on."""
        manifest = {"facts": dict(facts), "files": _artifacts(folder)}
        temporary = folder / f"{MANIFEST}.tmp"
        temporary.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        temporary.replace(folder / MANIFEST)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the block, then put back what was there."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
