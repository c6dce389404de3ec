"""What the server is measured against, each run in-process as a child of the harness: ChatTTS's own
``infer()`` (:mod:`bench.baselines.infer`), the engine stepped directly (:mod:`bench.baselines.engine`),
and one system loaded once answering measurement commands (:mod:`bench.baselines.system`).

Baselines import the harness only.
"""
