"""``python -m bench``: run the harness (see :mod:`bench.harness.cli`)."""

import sys

from bench.harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
