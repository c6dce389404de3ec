"""``python -m bench.soak``: see :mod:`bench.soak.run`."""

from bench.soak.run import main

raise SystemExit(main())
