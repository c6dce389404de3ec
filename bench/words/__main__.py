"""``python -m bench.words``: see :mod:`bench.words.timing`."""

from bench.words.timing import main

raise SystemExit(main())
