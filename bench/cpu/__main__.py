"""``python -m bench.cpu``: see :mod:`bench.cpu.realtime`."""

from bench.cpu.realtime import main

raise SystemExit(main())
