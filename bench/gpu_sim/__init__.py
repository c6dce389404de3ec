"""The simulated GPU (``python -m bench.gpu_sim``): the server's policy and engine core on a modelled H100."""
