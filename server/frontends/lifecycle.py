"""How a connection that holds streams lets go of them: the one ending every front end uses.

A connection's handler ends in its ``finally``, and that ``finally`` may itself be cancelled
at its first ``await``: aiohttp cancels a handler whose client went away, and a server that
stops cancels what is left. An ending that first awaits its pump tasks and only then frees
its streams loses the freeing to that cancellation: the streams go on generating into
buffers nobody reads, stay in ``chattts_active_streams`` for good and hold every drain to
its timeout (issue 42, finding 1: the ElevenLabs WebSocket closed mid-turn, as pipecat and
LiveKit do on every interruption). :func:`end_connection` is called first in the handler's
``finally``: it lets go of the streams synchronously (no cancellation can come between),
cancels the tasks, and only then waits for them, shielded, so that a repeated cancellation
of the handler neither skips anything nor leaves a task unawaited (each was cancelled
already and ends on its own).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any


async def end_connection(release: Callable[[], None], tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Let go of a finished connection's streams, then stop and await its tasks.

    Call it as the first statement of the handler's ``finally``. Everything before its first
    ``await`` runs at once: ``release`` (free, abandon or detach the streams; it wakes their
    pumps, whose leases are revoked) and the cancel of every task. The wait that follows is
    shielded: a cancellation of the caller still raises there, but the tasks have been told
    to end and the streams are let go already.

    Args:
        release: lets go of the connection's streams; runs first, whatever happens.
        tasks: the connection's pump (and relay) tasks.
    """
    pending = [task for task in tasks if task is not asyncio.current_task()]
    try:
        release()
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
