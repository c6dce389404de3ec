"""Shared fixtures: every async test runs on uvloop, like the server; the tiny model's folder.

Every server a test starts runs the eager step (``--profile eager``) unless the test names a
profile or step flag: the default, ``realtime``, compiles the CPU step for minutes at start-up,
and some thousand tests start servers. ``CHATTTS_PROFILE`` here reaches the servers built in
this process from ``os.environ`` and the subprocesses started with a copy of it;
:func:`tests.serverproc.spawn_server` and the model fixtures name it themselves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import uvloop

from tests.netguard import network_refused

#: The profile of every server the tests start (``tests/model/test_profile.py`` starts the default).
HARNESS_PROFILE = "eager"
os.environ.setdefault("CHATTTS_PROFILE", HARNESS_PROFILE)


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Any]:
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight ChatTTS model, written once per session (tests/model and tests/bench)."""
    pytest.importorskip("ChatTTS")
    from server.engine.chattts.devmodel import make_dev_model

    directory = tmp_path_factory.mktemp("tiny-chattts")
    with network_refused():
        make_dev_model("tiny", directory, seed=0)
    return directory
