"""Counting what the engine does around its token step: host syncs and ops dispatched outside it.

:class:`OpCount` stacks a ``TorchFunctionMode`` (reads spelled in Python: ``tolist``,
``item``, ``bool(t)``, ``.cpu()``, ``.numpy()``; on the CPU they dispatch nothing, so only
this level sees them) and a ``TorchDispatchMode`` (every aten op, and the syncs a library
hides from Python: ``_local_scalar_dense``, ``nonzero``, a device→host copy). A sync seen at
both levels (``bool(t)`` dispatches ``_local_scalar_dense``) counts once.

Regions stand in for what a GPU runs as graphs: :class:`MarkedRunner` wraps the eager step
(a CUDA graph replay on a GPU: one launch), and :meth:`OpCount.mark` wraps any other stage
(the decode, which issue 43's point 3 captures). Ops and syncs inside a region are counted
apart from the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from server.engine.chattts.step.graphs import EagerRunner

#: Python-level reads of a tensor's values.
_READS = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__array__",
    "nonzero",
    "is_nonzero",
    "masked_select",
    "unique",
}
#: aten ops that wait for the device and bring a value to the host.
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::masked_select"}


def _to_host(func_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A copy from a device tensor into host memory (never true on the CPU, where all is host)."""
    if func_name == "aten::copy_" and len(args) >= 2:
        dst, src = args[0], args[1]
        return bool(dst.device.type == "cpu" and src.device.type != "cpu")
    if func_name == "aten::_to_copy" and args:
        target = kwargs.get("device")
        to_cpu = target is not None and torch.device(target).type == "cpu"
        return bool(to_cpu and args[0].device.type != "cpu")
    return False


class OpCount:
    """Host syncs and dispatched ops, inside and outside marked regions (see the module docstring)."""

    def __init__(self) -> None:
        self.region: str | None = None
        self.outside: Counter[str] = Counter()
        self.inside: Counter[str] = Counter()  # ops per region
        self.syncs: list[str] = []  # outside every region
        self.region_syncs: Counter[str] = Counter()
        self.steps = 0  # marked step runs
        self._reading = False

    def reset(self) -> None:
        self.outside.clear()
        self.inside.clear()
        self.syncs.clear()
        self.region_syncs.clear()
        self.steps = 0

    def sync(self, name: str) -> None:
        if self.region is None:
            self.syncs.append(name)
        else:
            self.region_syncs[self.region] += 1

    @contextmanager
    def within(self, region: str) -> Iterator[None]:
        outer, self.region = self.region, self.region or region
        try:
            yield
        finally:
            self.region = outer

    def mark(self, fn: Callable[..., Any], region: str) -> Callable[..., Any]:
        def marked(*args: Any, **kwargs: Any) -> Any:
            with self.within(region):
                return fn(*args, **kwargs)

        return marked

    @contextmanager
    def counting(self) -> Iterator[OpCount]:
        with _Reads(self), _Ops(self):
            yield self


class _Reads(TorchFunctionMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and "cpu" in (*[str(a) for a in args[1:]], str(kwargs.get("device")))
        if (name in _READS or to_cpu) and not self.count._reading:
            self.count.sync(name)
            self.count._reading = True
            try:
                return func(*args, **kwargs)
            finally:
                self.count._reading = False
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        count = self.count
        if count.region is None:
            count.outside[name] += 1
        else:
            count.inside[count.region] += 1
        if not count._reading and (name in _SYNC_OPS or _to_host(name, args, kwargs)):
            count.sync(name)
        return func(*args, **kwargs)


class MarkedRunner:
    """The eager step, its ops counted as one captured region (a graph replay on a GPU)."""

    kind = "eager"

    def __init__(self, step: Any, count: OpCount) -> None:
        self._inner = EagerRunner(step)
        self._count = count

    def prepare(self, shapes: Any) -> None:
        self._inner.prepare(shapes)

    def run(self, batch: int, length: int) -> None:
        with self._count.within("step"):
            self._inner.run(batch, length)
        self._count.steps += 1
