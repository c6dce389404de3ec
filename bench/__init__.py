"""Latency and throughput harness for protocol-v1 streaming TTS servers (``python -m bench``).

See ``bench/README.md`` for the command line, the metrics and committed results.
"""
