"""The engine's own ceiling: ``ChatTTSEngine`` stepping N sequences directly, in-process.

``python -m bench.baselines.engine --model-dir DIR --concurrency 8 --out X.json``

No server, no sockets, no scheduler: the loop keeps N jobs live, steps all
of them together and replaces each finished job with the next one (closed
loop), the way a perfectly efficient server would. Same engine settings as
``serve``'s defaults (device ``auto``, dtype ``auto``, the engine's own block
schedule); a job's text is split into segments as the server splits it,
and a job's segments run one after another in its slot. ``--max-audio-s``
ends a job the way the harness's cancel ends a server stream: once the job
has made that much audio in all (its row dropped mid-block, its later
segments never started), not per segment, and counting no audio past the cap
(the harness's client drops what its stream sends after the frame that
reaches the cap); each segment's tokens are capped too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.harness import inproc
from bench.harness.audio import DEFAULT_SILENCE_THRESHOLD
from bench.harness.latency import StreamRecord
from bench.harness.load import LoadRun
from bench.harness.servers import engine_thread_figures
from bench.harness.textset import BenchText, Job, job, seed_base


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


class ClosedLoop:
    """N jobs kept live on one engine, stepped together, each finished job replaced at once.

    Args:
        engine: a loaded, warmed-up ``ChatTTSEngine``.
        texts: the text set.
        max_tokens: the token cap of every segment.
        segment_max_chars: how the server would split a job's text.
        max_audio_samples: a job's audio cap in all (0: none), as the harness caps a stream.
    """

    def __init__(
        self,
        engine: Any,
        texts: list[BenchText],
        *,
        max_tokens: int,
        segment_max_chars: int,
        max_audio_samples: int = 0,
    ) -> None:
        self.engine, self.texts = engine, texts
        self.max_tokens, self.segment_max_chars = max_tokens, segment_max_chars
        self.max_audio_samples = max_audio_samples
        self._next_seq = 0
        self._steps = StepTally()

    def _submit(self, slot: _Slot) -> None:
        from server.engine_api import SequenceRequest, SynthesisParams

        text = slot.pending.pop(0)
        k = len(slot.segments) - len(slot.pending) - 1
        params = SynthesisParams(seed=slot.job.seed)
        request = SequenceRequest(
            seq_id=self._next_seq, text=text, params=params, max_tokens=self.max_tokens, seed_offset=k
        )
        self.engine.add(request)
        slot.seq_id = self._next_seq
        self._next_seq += 1

    def _new_slot(self, index: int, base: int) -> _Slot:
        from server.text.segments import split_segments

        j = job(self.texts, index, base)
        segments = split_segments(j.text.text, max_chars=self.segment_max_chars)
        record = StreamRecord(
            job=j.index, system="engine-direct", fmt="f32", text_size=j.text.size, text_lang=j.text.lang
        )
        slot = _Slot(job=j, segments=segments, record=record, pending=list(segments))
        record.t_send = time.perf_counter()
        self._submit(slot)
        return slot

    def run(
        self,
        concurrency: int,
        duration_s: float,
        *,
        base_seed: int,
        max_streams: int = 1000,
        cut: bool = False,
    ) -> LoadRun:
        """One scenario; ``cut``: drop the jobs still running when the load ends instead of finishing them."""
        run = LoadRun(t_start=time.perf_counter())
        self._steps = StepTally()
        deadline = run.t_start + duration_s
        index = 0
        slots: list[_Slot] = []
        while True:
            while len(slots) < concurrency and index < max_streams and time.perf_counter() < deadline:
                slots.append(self._new_slot(index, base_seed))
                index += 1
            if not run.t_stop and len(slots) < concurrency:  # a slot was not refilled: the load ends
                run.t_stop = time.perf_counter()
            if not slots or (cut and run.t_stop):
                break
            stepped = time.perf_counter()
            results = {r.seq_id: r for r in self.engine.step([s.seq_id for s in slots])}
            now = time.perf_counter()
            self._steps.add(now - stepped, len(slots), max((r.tokens for r in results.values()), default=0))
            for slot in list(slots):
                result = results[slot.seq_id]
                audio = result.audio
                if self.max_audio_samples:
                    # The harness's cancel ends its stream's iteration at the frame that reaches the
                    # cap and drops the rest of the block: a server is credited with no audio past
                    # the cap, so neither is the engine.
                    audio = audio[: max(0, self.max_audio_samples - slot.record.samples)]
                if audio.size:
                    _note_audio(slot.record, audio, now)
                capped = self.max_audio_samples and slot.record.samples >= self.max_audio_samples
                if capped and not (result.finished and not slot.pending):
                    # The harness cancels a stream once it has the cap: the rest is never made.
                    if not result.finished:
                        self.engine.drop(slot.seq_id)
                    slot.record.capped, slot.record.reason, slot.record.t_done = True, "cancelled", now
                    run.records.append(slot.record)
                    slots.remove(slot)
                elif result.finished:
                    if slot.pending:
                        self._submit(slot)
                    else:
                        slot.record.t_done, slot.record.reason = now, "complete"
                        run.records.append(slot.record)
                        slots.remove(slot)
        for slot in slots:  # cut
            self.engine.drop(slot.seq_id)
            slot.record.cut, slot.record.t_done = True, time.perf_counter()
            run.records.append(slot.record)
        run.t_stop = run.t_stop or time.perf_counter()
        run.t_end = time.perf_counter()
        return run

    def engine_thread(self, wall_s: float) -> dict[str, Any]:
        """The last run's steps as a server's ``/metrics`` would show them (``engine_thread_figures``)."""
        return self._steps.figures(wall_s)


@dataclass
class StepTally:
    """Engine steps of one run: their wall time, rows and token steps (a block's longest row)."""

    steps: int = 0
    seconds: float = 0.0
    rows: int = 0
    token_steps: int = 0

    def add(self, seconds: float, rows: int, tokens: int) -> None:
        """One engine step of ``rows`` rows that advanced at most ``tokens`` tokens in ``seconds``."""
        self.steps += 1
        self.seconds += seconds
        self.rows += rows
        self.token_steps += tokens

    def figures(self, wall_s: float) -> dict[str, Any]:
        """``engine_thread_figures`` (bench.harness.servers) of these steps, as ``/metrics`` counts them."""
        counted = {
            "chattts_block_seconds_count": float(self.steps),
            "chattts_block_seconds_sum": self.seconds,
            "chattts_block_tokens_sum": float(self.token_steps),
            "chattts_batch_size_sum": float(self.rows),
        }
        return engine_thread_figures({}, counted, wall_s)


def add_engine_arguments(parser: Any) -> None:
    """The engine options an in-process run takes (``serve``'s flags of the same names)."""
    parser.add_argument("--block-schedule", default="", help="e.g. 8,16,32 (default: the engine's own)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantize", default="none", help="the engine's --quantize (none, int8, w8a8)")
    parser.add_argument("--compile-step", default="off", help="the engine's --compile-step (on, off)")
    parser.add_argument("--segment-max-chars", type=int, default=120)


def load_engine(args: Any) -> tuple[Any, float]:
    """The engine the arguments describe, loaded and warmed up, and the seconds that took."""
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.options import EngineOptions
    from server.engine.flags import parse_block_schedule

    default = EngineOptions().block_schedule
    blocks = parse_block_schedule(args.block_schedule) if args.block_schedule else default
    began = time.perf_counter()
    engine = ChatTTSEngine.load(
        model_dir=args.model_dir,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads or None,
        options=EngineOptions(
            # One KV slot per stream of the largest level (never fewer than the server's default):
            # a level above the default would otherwise fail on its 17th stream.
            max_batch=max([EngineOptions().max_batch, *inproc.concurrencies(args)]),
            block_schedule=blocks,
            quantize=args.quantize,
            compile_step=args.compile_step == "on",
        ),
    )
    engine.warmup()
    return engine, time.perf_counter() - began


def closed_loop(engine: Any, args: Any) -> ClosedLoop:
    """The closed loop the arguments describe (texts, ``--max-audio-s``, ``--segment-max-chars``)."""
    max_tokens = inproc.cap_tokens(args.max_audio_s)
    texts = inproc.texts_from(args)
    return ClosedLoop(
        engine,
        texts,
        max_tokens=max_tokens,
        segment_max_chars=args.segment_max_chars,
        max_audio_samples=round(args.max_audio_s * inproc.SAMPLE_RATE),
    )


def main() -> int:
    """Run the scenarios and write the JSON."""
    parser = inproc.base_parser(__doc__ or "")
    add_engine_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine, load_s = load_engine(args)
    loop = closed_loop(engine, args)
    scenarios = []
    for concurrency in inproc.concurrencies(args):
        cpu0 = inproc.cpu_now()
        base = seed_base(args.seed, f"c{concurrency}")
        run = loop.run(concurrency, args.duration, base_seed=base, max_streams=args.max_streams)
        scenario = inproc.scenario_result(concurrency, run, inproc.cpu_now() - cpu0)
        scenario["engine_thread"] = loop.engine_thread(run.t_end - run.t_start)
        scenarios.append(scenario)
    info = {
        "system": "engine-direct",
        "load_s": load_s,
        "dtype": engine.info.extra.get("dtype"),
        "device": engine.info.extra.get("device"),
        "block_schedule": ",".join(map(str, engine.block_schedule)),
        "quantize": args.quantize,
        "token_step": engine.info.extra.get("token_step"),
        "max_tokens": loop.max_tokens,
        "random_weights": engine.random_weights,
    }
    engine.close()
    inproc.write_results(args.out, scenarios, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
