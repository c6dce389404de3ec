"""The engine's own ceiling: ``ChatTTSEngine`` stepping N sequences directly, in-process.

``python -m bench.engine_direct --model-dir DIR --concurrency 8 --out X.json``

No server, no sockets, no scheduler: the loop keeps N jobs live, steps all
of them together and replaces each finished job with the next one (closed
loop), the way a perfectly efficient server would. Same engine settings as
``serve``'s defaults (device ``auto``, dtype ``auto``, block schedule
``8,16,32``); a job's text is split into segments as the server splits it,
and a job's segments run one after another in its slot. ``--max-audio-s``
caps each segment's tokens the way the harness's cancel caps server streams.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from bench import inproc
from bench.audio import DEFAULT_SILENCE_THRESHOLD
from bench.latency import StreamRecord
from bench.load import LoadRun
from bench.textset import Job, job, seed_base


@dataclass
class _Slot:
    job: Job
    segments: list[str]
    record: StreamRecord
    seq_id: int = -1
    pending: list[str] = field(default_factory=list)


def _note_audio(record: StreamRecord, audio: np.ndarray, now: float) -> None:
    """Append one step's audio as a frame; note the first non-silent sample."""
    if record.t_first_loud is None:
        loud = np.flatnonzero(np.abs(audio) >= DEFAULT_SILENCE_THRESHOLD / 32768.0)
        if loud.size:
            record.t_first_loud, record.first_loud_sample = now, record.samples + int(loud[0])
    record.frames.append((now, int(audio.size)))


def main() -> int:
    """Run the scenarios and write the JSON."""
    parser = inproc.base_parser(__doc__ or "")
    parser.add_argument("--block-schedule", default="8,16,32")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantize", default="none", help="the engine's --quantize (none, int8)")
    parser.add_argument("--segment-max-chars", type=int, default=120)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.options import EngineOptions
    from server.engine_api import SequenceRequest, SynthesisParams
    from server.text.segments import split_segments

    began = time.perf_counter()
    engine = ChatTTSEngine.load(
        model_dir=args.model_dir,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads or None,
        options=EngineOptions(
            block_schedule=tuple(int(b) for b in args.block_schedule.split(",")), quantize=args.quantize
        ),
    )
    engine.warmup()
    load_s = time.perf_counter() - began
    texts = inproc.texts_from(args)
    max_tokens = inproc.cap_tokens(args.max_audio_s)
    next_seq = 0

    def submit(slot: _Slot) -> None:
        nonlocal next_seq
        text = slot.pending.pop(0)
        k = len(slot.segments) - len(slot.pending) - 1
        params = SynthesisParams(seed=slot.job.seed)
        engine.add(
            SequenceRequest(seq_id=next_seq, text=text, params=params, max_tokens=max_tokens, seed_offset=k)
        )
        slot.seq_id = next_seq
        next_seq += 1

    def new_slot(index: int, base: int) -> _Slot:
        j = job(texts, index, base)
        segments = split_segments(j.text.text, max_chars=args.segment_max_chars)
        record = StreamRecord(
            job=j.index, system="engine-direct", fmt="f32", text_size=j.text.size, text_lang=j.text.lang
        )
        slot = _Slot(job=j, segments=segments, record=record, pending=list(segments))
        record.t_send = time.perf_counter()
        submit(slot)
        return slot

    scenarios = []
    for concurrency in inproc.concurrencies(args):
        run = LoadRun(t_start=time.perf_counter())
        cpu0 = inproc.cpu_now()
        deadline = run.t_start + args.duration
        index = 0
        slots: list[_Slot] = []
        while True:
            while len(slots) < concurrency and index < args.max_streams and time.perf_counter() < deadline:
                slots.append(new_slot(index, seed_base(args.seed, f"c{concurrency}")))
                index += 1
            if not slots:
                break
            if not run.t_stop and len(slots) < concurrency:  # a slot was not refilled: the load ends
                run.t_stop = time.perf_counter()
            results = {r.seq_id: r for r in engine.step([s.seq_id for s in slots])}
            now = time.perf_counter()
            for slot in list(slots):
                result = results[slot.seq_id]
                if result.audio.size:
                    _note_audio(slot.record, result.audio, now)
                if result.finished:
                    if slot.pending:
                        submit(slot)
                    else:
                        slot.record.t_done, slot.record.reason = now, "complete"
                        run.records.append(slot.record)
                        slots.remove(slot)
        run.t_stop = run.t_stop or time.perf_counter()
        run.t_end = time.perf_counter()
        scenarios.append(inproc.scenario_result(concurrency, run, inproc.cpu_now() - cpu0))
    info = {
        "system": "engine-direct",
        "load_s": load_s,
        "dtype": engine.info.extra.get("dtype"),
        "device": engine.info.extra.get("device"),
        "block_schedule": args.block_schedule,
        "quantize": args.quantize,
        "max_tokens": max_tokens,
        "random_weights": engine.random_weights,
    }
    engine.close()
    inproc.write_results(args.out, scenarios, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
