"""``python -m bench.gpu_sim``: see :mod:`bench.gpu_sim.search`."""

from bench.gpu_sim.search import main

raise SystemExit(main())
