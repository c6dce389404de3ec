"""The CPU step's attention as one C++ operator that reads each row only as far as it reaches.

The token step attends every row of the batch over the longest row's length bucket
(:mod:`server.engine.chattts.step.kv`): a closed set of shapes, which the compiled step and
CUDA graphs need. But at eight streams the rows are of every age, so a dense attention reads
each row's keys and values far past the row's own end, masked, and on a CPU those bytes are
the attention's cost (``bench/results/studies/attention-epyc-2core.md``: 157 MB per step at 8 × 320
positions, 10 ms). ``chattts_stream::decode_attention`` (``csrc/decode_attention.cpp``) keeps
the step's shapes and its mask, and computes :func:`~server.engine.chattts.step.llama.math_attention`'s
arithmetic (float32 scores, softmax, weighted sum) per row and head, stopping at the row's
last unmasked position. Inductor calls it as an opaque operator, so it is used only where
the slot views reach it unconverted: the CPU's compiled step (``--compile-step on`` or
``ahead``), at every batch size (:func:`step_attention`).

It is built with PyTorch's C++ extension loader (``torch.utils.cpp_extension.load``: a C++
compiler and ninja, which the compiled step needs anyway) the first time a process asks for it,
and cached in ``TORCH_EXTENSIONS_DIR`` (the server's default: ``<cache dir>/compiled/torch_extensions``,
a folder per Python and torch version, :func:`server_build_root`; on a volume in the images): about 12 s
on two cores the first time, a load afterwards. Builds are serialized across processes by an
``flock``, under which a baton left by a killed build is removed (:func:`_build_lock`). A
build that fails is logged once and the step keeps
:func:`~server.engine.chattts.step.llama.math_attention` (the same values, slower).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
NAME = "chattts_stream_decode_attention"
OPERATOR = "chattts_stream::decode_attention"

_lock = threading.Lock()
_state: dict[str, bool] = {}


def _register_fake() -> None:
    """Shapes for tracing: the output is ``q``'s shape, contiguous (as the kernel returns it)."""

    @torch.library.register_fake(OPERATOR)  # type: ignore[untyped-decorator]
    def _fake(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return q.new_empty(q.shape)


def load() -> bool:
    """Build (or load from the cache) and register the operator; False, logged, where it cannot be."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = build(SOURCE, NAME)
            if _state["loaded"]:
                _register_fake()
        return _state["loaded"]


def build(source: Path, name: str) -> bool:
    """Compile ``source`` as the extension ``name`` and load it into this process; False, logged, if not."""
    try:
        from torch.utils.cpp_extension import load as load_extension

        directory = build_directory(name)
        with _build_lock(directory):
            load_extension(
                name=name,
                sources=[str(source)],
                # at::parallel_for is OpenMP in PyTorch's builds, and a pragma without -fopenmp is
                # silently one thread. The library it links, libgomp.so.1, is the one torch loaded.
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:
        log.warning("the C++ decode attention could not be built (%s); the step uses math_attention", exc)
        return False
    return True


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built and cached: ``TORCH_EXTENSIONS_DIR/name``.

    Without ``TORCH_EXTENSIONS_DIR``, a folder per Python and torch version under torch's
    default root (``~/.cache/torch_extensions``), so an upgraded torch never loads a library
    built against another's headers.
    """
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        root = os.path.join(get_default_build_root(), version_folder())
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def version_folder() -> str:
    """``py311_torch2.13.0_cpu``: a library built against one Python's and torch's headers is kept apart."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return version.replace("+", "_")


def server_build_root(cache_root: Path) -> Path:
    """The server's ``TORCH_EXTENSIONS_DIR`` when none is set: in its cache dir, beside the compiled step."""
    return cache_root / "compiled" / "torch_extensions" / version_folder()


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold the build folder against other processes, and clear the baton a dead one left.

    torch's loader guards a build with a file (``lock``) that its holder deletes when done; a
    process killed while holding it (a SIGKILL, the OOM killer, a stopped CI run) leaves the
    file, and every later load of the extension waits for it forever, even when the library
    is built. An ``flock`` is released by the kernel when its holder dies, so under it no live
    process of ours holds the baton, and one that exists is stale.
    """
    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = directory / "lock"
            if baton.exists():
                log.warning("removing %s, left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`~server.engine.chattts.step.llama.math_attention`, each row read up to its mask's end.

    Args:
        q: ``(b, heads, 1, dim)``.
        keys: ``(b, kv_heads, length, dim)`` bf16 or float32, the head dimension contiguous.
        values: as ``keys``.
        mask: ``(b, 1, 1, length)`` bool, True where a row may attend.
        scale: the scores' factor.
    """
    result: torch.Tensor = torch.ops.chattts_stream.decode_attention(q, keys, values, mask, scale)
    return result


def step_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """The compiled CPU step's attention: :func:`decode_attention`, for one row as for a batch.

    At a batch the operator reads about half the bytes (0.50-0.55 of the dense time at 4 and
    8 rows of every age). One row has nothing to skip, yet the operator wins there too, for
    another reason: given the dense form, inductor fuses the rotary embedding of the query
    into the attention's loop over key positions, and computes a cosine and a sine per
    element of every position, head and layer (about 8 million a step at 256 positions: 3 %
    of the step's CPU time in ``Sleef_cosf16``/``sinf16`` alone). An opaque operator makes
    the query a tensor first, turned once. The whole batch-1 step, built ahead of time, took
    0.90-0.98x the dense form's time by medians in three interleaved A/Bs in one process, a
    gain about as large as this 2-core VM's noise (the batch-8 control moved 0.95x):
    ``bench/results/studies/step-attention-epyc-2core.md``.
    """
    return decode_attention(q, keys, values, mask, scale)
