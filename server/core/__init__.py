"""The engine side of the server: a pure scheduling policy, the inference loop, its client.

- ``events``: the typed commands and events that cross between the event loop and the loop thread.
- ``plan``: one stream as the policy sees it (look-ahead, held audio, order of events).
- ``policy``: :class:`SchedulingPolicy`, pure: ``schedule(now)`` and ``update(batch, outcome, now)``.
- ``engine_core``: :class:`EngineCore`, the inference thread's loop over commands and engine steps.
- ``client``: :class:`EngineClient`, ``generate(request)`` → events, ``abort(id)`` (the event loop's side).

Nothing here imports the wire protocol.
"""
