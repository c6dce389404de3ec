"""The GPU suite (``python -m bench.gpu``): the one-command check on a CUDA machine."""
