"""The bench smoke tests: each runs a ``python -m bench...`` harness end to end, small.

Every test collected under this folder is marked ``bench`` (``-m "not bench"`` leaves them
out); those that run the tiny ChatTTS model are marked ``model`` in their module too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hooks see the whole session's items: mark only this folder's.
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.bench)


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harnesses' subprocesses inherit it: no bench smoke test downloads anything."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
