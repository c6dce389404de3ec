"""Baseline (a): ChatTTS's own ``infer(stream=True)``, in-process, batched.

``python -m bench.baselines.infer --model-dir DIR --concurrency 1,4 --out X.json``

For each concurrency N it runs closed-loop rounds: one ``infer`` call with
the next N texts of the job sequence (ChatTTS batches them), iterated to the
end, until the duration or count bound. Loading goes through the server's
``load_chat`` (the dev model's hashes are set on ``chat.sha256_map`` there).
Settings are ChatTTS's stock streaming ones (float32, ``stream_batch`` 24,
first 2 yields dropped) with ``skip_refine_text=True`` and
``split_text=False``, the fastest documented path.

Per row: a yield is a ``(B, n)`` array shared by the batch; the row's audio
ends at its last sample above ChatTTS's own silence threshold (1e-5), so the
padding of rows that ended early is not counted as audio.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from bench.harness import inproc
from bench.harness.audio import DEFAULT_SILENCE_THRESHOLD
from bench.harness.latency import StreamRecord
from bench.harness.load import LoadRun, poisson_arrivals
from bench.harness.textset import BenchText, Job, job, seed_base

PAD_THRESHOLD = 1e-5


def _row_record(j: Job, chunks: list[tuple[float, np.ndarray]], t_send: float) -> StreamRecord:
    """One row's record: chunks up to its last non-padding sample, first loud sample."""
    audio = np.concatenate([c for _, c in chunks]) if chunks else np.zeros(0, np.float32)
    loud = np.flatnonzero(np.abs(audio) > PAD_THRESHOLD)
    length = int(loud[-1]) + 1 if loud.size else 0
    record = StreamRecord(
        job=j.index,
        system="chattts-infer",
        fmt="f32",
        text_size=j.text.size,
        text_lang=j.text.lang,
        t_send=t_send,
    )
    offset = 0
    for t, chunk in chunks:
        n = max(0, min(len(chunk), length - offset))
        if n:
            record.frames.append((t, n))
        offset += len(chunk)
    audible = np.flatnonzero(np.abs(audio[:length]) >= DEFAULT_SILENCE_THRESHOLD / 32768.0)
    if audible.size:
        first = int(audible[0])
        record.first_loud_sample = first
        record.t_first_loud = _time_of_sample(chunks, first)
    record.t_done = chunks[-1][0] if chunks else t_send
    record.reason = "complete"
    return record


def _time_of_sample(chunks: list[tuple[float, np.ndarray]], index: int) -> float:
    offset = 0
    for t, chunk in chunks:
        offset += len(chunk)
        if index < offset:
            return t
    return chunks[-1][0]


def infer_batch(chat: Any, jobs: list[Job], params: Any) -> list[StreamRecord]:
    """One ``infer(stream=True)`` call over ``jobs``; a record per row."""
    texts = [j.text.text for j in jobs]
    per_row: list[list[tuple[float, np.ndarray]]] = [[] for _ in jobs]
    t_send = time.perf_counter()
    for wavs in chat.infer(
        texts, stream=True, skip_refine_text=True, split_text=False, params_infer_code=params
    ):
        now = time.perf_counter()
        array = np.asarray(wavs, dtype=np.float32).reshape(len(jobs), -1)
        if array.shape[1] == 0:
            continue
        for row, chunk in zip(per_row, array, strict=True):
            row.append((now, chunk))
    return [_row_record(j, chunks, t_send) for j, chunks in zip(jobs, per_row, strict=True)]


def open_loop(chat: Any, texts: list[BenchText], rate: float, args: Any, params: Any) -> LoadRun:
    """Poisson arrivals served by ``infer``: when idle, all that wait (up to ``--max-batch``) form one batch.

    Each record's request time is its arrival, so queueing counts in its latency.
    """
    arrivals = poisson_arrivals(rate, args.duration, args.max_streams, args.seed)
    run = LoadRun(t_start=time.perf_counter())
    served = 0
    while served < len(arrivals):
        time.sleep(max(0.0, run.t_start + arrivals[served] - time.perf_counter()))
        now = time.perf_counter() - run.t_start
        waiting = [i for i in range(served, len(arrivals)) if arrivals[i] <= now][: args.max_batch]
        batch = [job(texts, i, seed_base(args.seed, f"r{rate:g}")) for i in waiting]
        records = infer_batch(chat, batch, params(batch[0].seed))
        for i, record in zip(waiting, records, strict=True):
            record.t_send = run.t_start + arrivals[i]
        run.records.extend(records)
        served += len(waiting)
    count_ran_out = len(arrivals) >= args.max_streams
    run.t_stop = run.t_start + (arrivals[-1] if count_ran_out else args.duration)
    run.t_end = time.perf_counter()
    return run


def main() -> int:
    """Run the scenarios and write the JSON."""
    parser = inproc.base_parser(__doc__ or "")
    parser.add_argument("--rates", default="", help="open-loop scenarios (Poisson arrivals per second)")
    parser.add_argument("--max-batch", type=int, default=16, help="open loop: most texts in one infer call")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    from server.engine.chattts.assets import load_chat

    if args.threads:
        torch.set_num_threads(args.threads)
    began = time.perf_counter()
    loaded = load_chat(model_dir=args.model_dir, device=torch.device("cpu"))
    chat = loaded.chat
    torch.manual_seed(2)
    speaker = chat.sample_random_speaker()
    load_s = time.perf_counter() - began
    texts = inproc.texts_from(args)
    max_tokens = inproc.cap_tokens(args.max_audio_s)

    def params(seed: int) -> Any:
        return chat.InferCodeParams(
            spk_emb=speaker, manual_seed=seed, max_new_token=max_tokens, show_tqdm=False, temperature=0.3
        )

    infer_batch(chat, [job(texts, 0, 0)], params(0))  # warm-up: numba normalizer, allocations
    scenarios = []
    for concurrency in inproc.concurrencies(args):
        run = LoadRun(t_start=time.perf_counter())
        cpu0 = inproc.cpu_now()
        deadline = run.t_start + args.duration
        index = 0
        while time.perf_counter() < deadline and index < args.max_streams:
            batch = [
                job(texts, index + k, seed_base(args.seed, f"c{concurrency}")) for k in range(concurrency)
            ]
            index += concurrency
            run.records.extend(infer_batch(chat, batch, params(batch[0].seed)))
        run.t_stop = time.perf_counter()  # every round held N rows until it ended
        run.t_end = time.perf_counter()
        scenarios.append(inproc.scenario_result(concurrency, run, inproc.cpu_now() - cpu0))
    for rate in [float(r) for r in args.rates.split(",") if r.strip()]:
        cpu0 = inproc.cpu_now()
        run = open_loop(chat, texts, rate, args, params)
        scenarios.append({**inproc.scenario_result(0, run, inproc.cpu_now() - cpu0), "rate": rate})
    info = {
        "system": "chattts-infer",
        "load_s": load_s,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "max_new_token": max_tokens,
        "stream_batch": chat.InferCodeParams.stream_batch,
        "pass_first_n_batches": chat.InferCodeParams.pass_first_n_batches,
        "random_weights": loaded.random_weights,
    }
    inproc.write_results(args.out, scenarios, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
