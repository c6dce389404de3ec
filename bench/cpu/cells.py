"""The cells of :mod:`bench.cpu`'s markdown: numbers, and load averages marked when the machine was busy."""

from __future__ import annotations

LOADED = 1.5  # a 1-minute load average above this on 2 cores: the number was taken on a loaded machine


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` to ``digits`` decimals; a dash where it was not measured."""
    return "—" if value is None or value != value else f"{value:.{digits}f}"


def load_note(load: float | None) -> str:
    """A load average, in bold above :data:`LOADED`."""
    if load is None:
        return "—"
    return f"**{load:.1f}**" if load > LOADED else f"{load:.1f}"
