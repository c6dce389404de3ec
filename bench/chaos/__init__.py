"""The chaos soak (``python -m bench.chaos``): normal clients stream while a hostile one attacks."""
