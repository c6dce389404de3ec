"""The CPU suite (``python -m bench.cpu``): every row of the CPU comparison in one run; the step; memory."""
