"""``python -m server`` runs the ``chattts-stream`` command."""

import sys

from server.cli import main

sys.exit(main())
