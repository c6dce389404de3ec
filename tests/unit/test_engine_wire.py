"""The engine process's wire and metrics: every command and event crosses unchanged.

``server.core.remote.wire`` (length-prefixed msgpack; arrays as raw bytes) and
``server.core.remote.recorder`` (the core's metrics recorded there, replayed here).
"""

from __future__ import annotations

import asyncio
import struct

import msgspec
import numpy as np
import pytest

from server.config import load_settings
from server.core import events as ev
from server.core.meters import INCREMENTED, OBSERVED, SET, CoreMetrics
from server.core.remote import wire
from server.core.remote.recorder import MetricOps, MetricRecorder, replay
from server.engine_api import EngineInfo, SynthesisParams, VoiceSample
from server.metrics import Metrics

CODES = np.arange(12, dtype=np.uint16).reshape(4, 3)
AUDIO = np.linspace(-1, 1, 999, dtype=np.float32)
VOICE = SynthesisParams(voice="v", seed=3, reference=VoiceSample(codes=CODES, transcript="说"))
COMMANDS: list[ev.Command] = [
    ev.Add(1, ("a", "b"), VOICE, input_closed=False, client="c", first_segment=2),
    ev.Append(1, "more"),
    ev.EndInput(1),
    ev.Cancel(1),
    ev.EncodeVoice(7, AUDIO, "transcript"),
    ev.Shutdown(),
]
EVENTS: list[ev.CoreEvent] = [
    ev.SegmentStarted(1, 0, "a"),
    ev.Audio(1, AUDIO, segment_end=True),
    ev.Ended(1, "error", "why"),
    ev.Loaded(EngineInfo(name="fake", voices=("a",), max_text_tokens=9, extra={"dtype": "float32"})),
    ev.LoadFailed("no"),
    ev.Ready(),
    ev.BreakerChanged(True),
    ev.Capacity(ev.Admission(3, 8, 0.25, False, {"c": 2}), 5),
    ev.VoiceEncoded(7, CODES),
    ev.VoiceEncoded(8, None, "bad recording"),
    ev.Heartbeat(),
    ev.Stopped(),
]


def body(frame: bytes) -> bytes:
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    return frame[4:]


def same(a: object, b: object) -> bool:
    """Equal, with arrays compared by dtype, shape and values (the value types compare arrays by identity)."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_crosses_unchanged(command: ev.Command) -> None:
    assert same(wire.decode_command(body(wire.encode_command(command))), command)


def test_every_command_and_event_type_has_a_decoder() -> None:
    assert {type(c) for c in COMMANDS} == set(wire.COMMANDS)
    assert {type(e) for e in EVENTS} == set(wire.EVENTS)


def test_an_event_batch_crosses_unchanged_with_its_metrics() -> None:
    ops = MetricOps((("block_time", 0.5),), (("engine_failures", "oom", 1.0),), (("breaker_open", 1.0),))
    events, got = wire.decode_events(body(wire.encode_events(EVENTS, ops)))
    assert got == ops
    assert len(events) == len(EVENTS) and all(same(a, b) for a, b in zip(events, EVENTS, strict=True))
    audio = events[1]
    assert isinstance(audio, ev.Audio) and audio.samples.dtype == np.float32
    assert not audio.samples.flags.writeable  # read in place from the frame: nobody may write to it


def test_the_settings_cross_unchanged() -> None:
    settings = load_settings(["--engine", "fake", "--fake-host-ms", "2", "--max-batch", "7"], env={})
    assert wire.decode_settings(body(wire.encode_settings(settings))) == settings


def test_a_frame_that_does_not_decode_is_refused_by_name() -> None:
    with pytest.raises(wire.WireError, match="unknown message 'Nope'"):
        wire.decode_command(msgspec.msgpack.encode(("Nope", {})))
    with pytest.raises(wire.WireError, match="does not decode"):
        wire.decode_command(msgspec.msgpack.encode(("Cancel", {"stream_id": "one"})))
    with pytest.raises(wire.WireError):
        wire.decode_events(b"\xc1")


async def test_frames_are_read_one_by_one_and_the_end_is_none() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(wire.encode_command(ev.Cancel(1)) + wire.encode_command(ev.Cancel(2)))
    reader.feed_eof()
    assert wire.decode_command(await wire.read_frame(reader) or b"") == ev.Cancel(1)
    assert wire.decode_command(await wire.read_frame(reader) or b"") == ev.Cancel(2)
    assert await wire.read_frame(reader) is None


async def test_a_frame_over_the_bound_is_refused() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(wire.WireError):
        await wire.read_frame(reader)


def exported(metrics: Metrics) -> dict[str, float]:
    """Every sample of ``/metrics`` but the creation times."""
    samples = (line.rsplit(" ", 1) for line in metrics.render().decode().splitlines() if line[:1] != "#")
    return {name: float(value) for name, value in samples if "_created" not in name}


def drive(metrics: CoreMetrics) -> None:
    """What the core does to its collectors in a step, a failure and a publish."""
    metrics.block_time.observe(0.02)
    metrics.block_time.observe(0.3)
    metrics.batch_size.observe(4)
    metrics.block_tokens.observe(16)
    metrics.queue_wait.observe(0.01)
    metrics.tokens.inc(64)
    metrics.tokens.inc(32)
    metrics.audio_seconds.inc(2.5)
    metrics.engine_failures.labels("oom").inc()
    metrics.engine_failures.labels("error").inc()
    for gauge in SET:
        getattr(metrics, gauge).set(5)
    metrics.running_sequences.set(3)


def test_replayed_metrics_equal_the_core_moving_the_collectors_itself() -> None:
    direct, replayed, recorder = Metrics(), Metrics(), MetricRecorder()
    drive(direct)
    drive(recorder)
    replay(recorder.take(), replayed)
    assert exported(replayed) == exported(direct)
    assert recorder.take() == MetricOps()  # taken: the next batch starts empty
    assert set(OBSERVED) | set(INCREMENTED) | set(SET) == {
        name for name in vars(MetricRecorder()) if name not in ("observed", "incremented", "gauges")
    }


def test_replay_moves_no_other_attribute() -> None:
    metrics = Metrics()
    before = exported(metrics)
    replay(MetricOps((("connections", 5.0),), (("errors", "x", 1.0),), (("active_streams", 9.0),)), metrics)
    assert exported(metrics) == before
