"""The load harness of ``python -m bench``: clients, load shapes, the listener model, stats, reports and
plots, and what every suite shares (server subprocesses, the machine's description, in-process engine
set-up, the plumbing of in-process children).

It imports nothing else from ``bench``: every suite builds on it.
"""
