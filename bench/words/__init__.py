"""Word timestamps against speech with known word boundaries (``python -m bench.words``; espeak-ng)."""
