"""The engine core in a process of its own (``--engine-process``), behind a local socket.

- ``wire.py``: commands, events and the settings as length-prefixed msgpack frames (audio as raw bytes);
- ``recorder.py``: the core's metrics recorded in the engine process and replayed in the front end's;
- ``host.py``: the engine process (``python -m server.core.remote.host``): the core on its thread;
- ``link.py``: the front end's side: starts the engine process, carries the frames, restarts it.
"""
