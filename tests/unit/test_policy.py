"""The scheduling policy, built and driven directly: schedule, feed results, assert (vLLM style).

No threads, no engine, no clock: each test runs in microseconds. Every rule in
``server/core/policy.py``'s docstring has a test here that fails when the rule
is removed (docs/architecture.md lists the one-line removals that were checked).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from server.core.admission import refusal, retry_after_ms
from server.core.events import Audio, BreakerChanged, CoreEvent, Ended, SegmentStarted
from server.core.policy import (
    BREAKER_MESSAGE,
    Batch,
    OutOfMemory,
    PolicyConfig,
    Probed,
    SchedulingPolicy,
    StepFailed,
    Stepped,
)
from server.engine_api import StepResult, SynthesisParams

PARAMS = SynthesisParams(seed=1)
LATER = 1.0  # past max_wait: the first batch is not held back to gather more


def make_policy(**config: object) -> SchedulingPolicy:
    # Look-ahead ungated unless a test says otherwise: the gate has tests of its own below.
    defaults = {"max_wait_s": 0.0, "lookahead_lead_s": 0.0}
    return SchedulingPolicy(PolicyConfig(**{**defaults, **config}))  # type: ignore[arg-type]


def add(
    policy: SchedulingPolicy, stream_id: int, segments: list[str], *, closed: bool = True
) -> list[CoreEvent]:
    return list(policy.add(stream_id, segments, PARAMS, input_closed=closed, now=0.0))


def result(seq_id: int, *, finished: bool = False, value: float = 0.5) -> StepResult:
    return StepResult(seq_id=seq_id, audio=np.full(4, value, np.float32), tokens=1, finished=finished)


def segment_of(batch: Batch, seq_id: int) -> str:
    return next(r.text for r in batch.add if r.seq_id == seq_id)


def run_step(
    policy: SchedulingPolicy, batch: Batch, finished: Iterable[int] = (), now: float = LATER
) -> list[CoreEvent]:
    done = set(finished)
    results = [result(s, finished=s in done) for s in batch.step]
    return policy.update(batch, Stepped(results, elapsed_s=0.01), now)


def ended(events: list[CoreEvent]) -> dict[int, Ended]:
    return {e.stream_id: e for e in events if isinstance(e, Ended)}


# --- look-ahead priority and the per-stream share ---------------------------------------------


def test_a_streams_first_segment_ranks_before_another_streams_look_ahead() -> None:
    policy = make_policy(max_batch=2, lookahead=3)
    add(policy, 0, [f"greedy {k}." for k in range(6)])
    add(policy, 1, ["the other stream."])
    batch = policy.schedule(LATER)
    assert [r.text for r in batch.add] == ["greedy 0.", "the other stream."]
    assert batch.step == tuple(r.seq_id for r in batch.add)


def test_a_look_ahead_segment_ranks_as_heard_once_its_listener_waits_for_it() -> None:
    policy = make_policy(max_batch=2, lookahead=1)
    add(policy, 0, ["a0.", "a1.", "a2."])
    add(policy, 1, ["b0 runs long.", "b1."])
    batch = policy.schedule(LATER)
    assert [r.text for r in batch.add] == ["a0.", "b0 runs long."]
    a0 = next(r.seq_id for r in batch.add if r.text == "a0.")
    run_step(policy, batch, finished=[a0])  # a1 (queued as look-ahead) is now what A's listener waits for
    add(policy, 2, ["c0.", "c1."])
    batch = policy.schedule(LATER)
    assert [r.text for r in batch.add] == ["a1."]  # before the newcomer's first segment and b1
    assert policy.admission().by_client == {"": 1}  # c0 is the one heard segment still waiting


def test_a_stream_queues_at_most_one_plus_lookahead_unfinished_segments() -> None:
    policy = make_policy(max_batch=16, lookahead=1)
    add(policy, 0, ["s0.", "s1.", "s2.", "s3.", "s4."])
    batch = policy.schedule(LATER)
    assert [r.text for r in batch.add] == ["s0.", "s1."]
    # Segment 0 finishes: exactly one more is queued, and joins at the next block boundary.
    run_step(policy, batch, finished=[batch.step[0]])
    assert [r.text for r in policy.schedule(LATER).add] == ["s2."]


def test_look_ahead_audio_is_held_until_the_segment_before_it_finishes() -> None:
    policy = make_policy(lookahead=1)
    add(policy, 0, ["first.", "second."])
    batch = policy.schedule(LATER)
    first, second = batch.step
    events = policy.update(
        batch, Stepped([result(second, finished=True, value=2.0), result(first, value=1.0)], 0.01), LATER
    )
    assert [type(e) for e in events] == [SegmentStarted, Audio]  # only segment 0's audio
    events = run_step(policy, policy.schedule(LATER), finished=[first])
    assert [type(e) for e in events] == [Audio, SegmentStarted, Audio, Ended]
    assert [float(e.samples[0]) for e in events if isinstance(e, Audio)] == [0.5, 2.0]  # then the held
    assert ended(events)[0].reason == "complete"


def test_held_segments_are_capped() -> None:
    # Segment 0 never finishes; every look-ahead segment finishes at once. Queueing must stop.
    policy = make_policy(max_batch=16, lookahead=1)
    add(policy, 0, ["a very long first segment.", *(f"short {k}." for k in range(1, 12))])
    first: int | None = None
    admitted = 0
    for _ in range(30):
        batch = policy.schedule(LATER)
        admitted += len(batch.add)
        if first is None:
            first = batch.step[0]
        run_step(policy, batch, finished=[s for s in batch.step if s != first])
    width = 1 + 1
    assert admitted == 1 + width + 1  # segment 0, then look-ahead until 1 + width are held


# --- look-ahead waits for a lead --------------------------------------------------------------


def audio_result(seq_id: int, seconds: float, *, finished: bool = False) -> StepResult:
    audio = np.zeros(int(seconds * 24_000), np.float32)
    return StepResult(seq_id=seq_id, audio=audio, tokens=1, finished=finished)


def test_a_look_ahead_steps_only_while_its_stream_is_ahead_of_real_time() -> None:
    policy = make_policy(lookahead=1, lookahead_lead_s=1.0)
    add(policy, 0, ["heard.", "ahead."])
    batch = policy.schedule(0.0)
    heard, ahead = (r.seq_id for r in batch.add)
    assert batch.step == (heard,)  # nothing heard yet: no lead, the heard segment steps alone
    policy.update(batch, Stepped([audio_result(heard, 1.5)], 0.3), 10.0)  # 1.5 s out at t = 10
    assert policy.schedule(10.2).step == (heard, ahead)  # 1.3 s ahead of a listener
    assert policy.schedule(10.6).step == (heard,)  # 0.9 s: below the lead again
    assert PolicyConfig().lookahead_lead_s == 1.0  # the default gates


def test_held_look_ahead_audio_counts_toward_the_lead_when_it_goes_out() -> None:
    policy = make_policy(lookahead=3, lookahead_lead_s=1.0)
    add(policy, 0, ["s0.", "s1.", "s2.", "s3."])
    batch = policy.schedule(0.0)
    s0, s1, s2, s3 = (r.seq_id for r in batch.add)
    policy.update(batch, Stepped([audio_result(s0, 1.2)], 0.1), 1.0)
    batch = policy.schedule(1.0)
    assert batch.step == (s0, s1, s2, s3)
    finish_s1 = [audio_result(s0, 0), audio_result(s1, 2.0, finished=True), audio_result(s2, 0)]
    finish_s1.append(audio_result(s3, 0))
    policy.update(batch, Stepped(finish_s1, 0.1), 1.1)  # s1's 2 s are held behind s0
    assert policy.schedule(1.5).step == (s0,)  # 1.2 s out, 0.5 s played: not ahead enough
    policy.update(Batch(step=(s0,)), Stepped([audio_result(s0, 0, finished=True)], 0.1), 1.6)
    # s0 ended, s1's held audio went out: 3.2 s out, 0.7 s played. s2 is heard, s3 may step.
    assert policy.schedule(1.7).step == (s2, s3)


def test_a_gated_look_ahead_steps_while_another_streams_heard_segment_waits_for_a_slot() -> None:
    policy = make_policy(max_batch=2, lookahead=1, lookahead_lead_s=1.0)
    add(policy, 0, ["a0.", "a1."])
    batch = policy.schedule(0.0)
    a0, a1 = (r.seq_id for r in batch.add)
    assert batch.step == (a0,)
    add(policy, 1, ["b0 waits for a slot."])
    batch = policy.schedule(0.1)
    assert not batch.add and batch.step == (a0, a1)  # a1 must finish to free b0's slot


# --- look-ahead yields its place to a newcomer ------------------------------------------------


def test_a_look_ahead_ahead_of_real_time_yields_its_place_to_a_newcomer() -> None:
    policy = make_policy(max_batch=2, lookahead=1, lookahead_lead_s=1.0)
    add(policy, 0, ["a0 runs long.", "a1."])
    batch = policy.schedule(0.0)
    a0, a1 = (r.seq_id for r in batch.add)
    policy.update(batch, Stepped([audio_result(a0, 3.0)], 0.1), 1.0)  # 3 s out at t = 1
    batch = policy.schedule(1.0)
    assert batch.step == (a0, a1)  # 3 s ahead of its listener: the look-ahead steps
    policy.update(batch, Stepped([result(a0), result(a1, value=7.0)], 0.1), 1.1)  # a1's audio is held
    add(policy, 1, ["b0 is a newcomer."])
    batch = policy.schedule(1.2)
    assert batch.drop == (a1,)  # every place taken: A's look-ahead gives its place up
    assert [r.text for r in batch.add] == ["b0 is a newcomer."]
    b0 = batch.add[0].seq_id
    assert batch.step == (a0, b0)
    # a0 ends; a1, queued again, is what A's listener waits for and takes the free place ...
    events = run_step(policy, batch, finished=[a0], now=1.3)
    a_audio = [float(e.samples[0]) for e in events if isinstance(e, Audio) and e.stream_id == 0]
    assert a_audio == [0.5]  # a0's last block; nothing of the a1 that gave its place up
    batch = policy.schedule(1.3)
    assert [(r.text, r.seed_offset) for r in batch.add] == [("a1.", 1)]  # the same seed: the same audio
    again = batch.add[0].seq_id
    # ... and is made afresh: only its new audio goes out, after a0's.
    events = policy.update(batch, Stepped([result(b0), result(again, finished=True, value=3.0)], 0.1), 1.4)
    assert [float(e.samples[0]) for e in events if isinstance(e, Audio) and e.stream_id == 0] == [3.0]
    assert ended(events)[0].reason == "complete"


def test_a_look_ahead_whose_stream_is_behind_its_lead_keeps_its_place() -> None:
    policy = make_policy(max_batch=2, lookahead=1, lookahead_lead_s=1.0)
    add(policy, 0, ["a0 runs long.", "a1."])
    batch = policy.schedule(0.0)
    a0, a1 = (r.seq_id for r in batch.add)
    policy.update(batch, Stepped([audio_result(a0, 1.5)], 0.1), 1.0)
    add(policy, 1, ["b0 waits."])
    batch = policy.schedule(1.6)  # 1.5 s out, 0.6 s played: 0.9 s ahead, under the lead
    assert batch.drop == () and batch.add == ()
    assert batch.step == (a0, a1)  # a1 steps to finish and free the place (the gate's rule)


def test_a_heard_segment_never_yields_its_place() -> None:
    policy = make_policy(max_batch=1, lookahead=1, lookahead_lead_s=1.0)
    add(policy, 0, ["a0 runs long.", "a1."])
    batch = policy.schedule(0.0)
    (a0,) = (r.seq_id for r in batch.add)
    policy.update(batch, Stepped([audio_result(a0, 5.0)], 0.1), 1.0)  # far ahead, but heard
    add(policy, 1, ["b0 waits."])
    batch = policy.schedule(1.1)
    assert batch.drop == () and batch.add == () and batch.step == (a0,)


def test_a_closed_loop_of_eight_streams_never_fills_the_cpus_sixteen_places() -> None:
    """The CPU's c8: 16 places, at most 1 + look-ahead rows a stream, a newcomer only after a stream
    ends. The yield rule needs a full batch, so it never acts and no look-ahead work is lost."""
    policy = make_policy(max_batch=16, lookahead=1, lookahead_lead_s=1.0)
    streams = iter(range(1000))

    def start() -> None:  # streams of 2 to 5 segments, so they come and go out of step
        stream = next(streams)
        add(policy, stream, [f"segment {k}." for k in range(2 + stream % 4)])

    for _ in range(8):
        start()
    age: dict[int, int] = {}
    now = 0.0
    for _ in range(200):
        now += 0.1
        batch = policy.schedule(now)
        assert batch.drop == () and policy.running_count <= 16
        for seq_id in batch.step:
            age[seq_id] = age.get(seq_id, 0) + 1
        # Every row makes 2 s of audio a step (far ahead of real time) and ends after 2 to 4 steps.
        results = [audio_result(s, 2.0, finished=age[s] >= 2 + s % 3) for s in batch.step]
        events = policy.update(batch, Stepped(results, 0.1), now)
        for _ in ended(events):  # a stream ends: its listener's next one starts (closed loop)
            start()
    assert next(streams) > 40  # streams came and went throughout


# --- admission -----------------------------------------------------------------------------------


def test_a_full_queue_refuses_with_a_retry_estimate() -> None:
    config = PolicyConfig(max_batch=1, max_queue=3, max_wait_s=0.0)
    policy = SchedulingPolicy(config)
    add(policy, 0, ["one."])
    add(policy, 1, ["two."])
    assert refusal(policy.admission(), config, pending=0) is None
    assert refusal(policy.admission(), config, pending=1) is not None  # submitted, not yet taken in
    batch = policy.schedule(LATER)
    policy.update(batch, Stepped([result(batch.step[0])], elapsed_s=0.1), LATER)
    add(policy, 2, ["three."])
    add(policy, 3, ["four."])
    assert policy.waiting_count == 3
    # 3 queued over a batch limit of 1: 4 batches ahead × 10 blocks × 0.06 s (moving average).
    assert refusal(policy.admission(), config, pending=0) == 2400
    assert refusal(policy.admission(), config, pending=0) == 4 * 10 * round(policy.seconds_per_block * 1000)


# --- fairness between clients (issue #25) -------------------------------------------------------


def add_for(policy: SchedulingPolicy, client: str, stream_id: int, text: str) -> None:
    policy.add(stream_id, [text], PARAMS, input_closed=True, now=0.0, client=client)


def test_clients_take_turns_in_the_queue() -> None:
    policy = make_policy(max_batch=2)
    for k in range(6):
        add_for(policy, "greedy", k, f"greedy {k}.")
    add_for(policy, "polite", 10, "polite.")
    batch = policy.schedule(LATER)
    assert [r.text for r in batch.add] == ["greedy 0.", "polite."]  # not "greedy 1."


def test_a_newcomer_is_served_in_the_current_round_not_after_the_backlog() -> None:
    policy = make_policy(max_batch=1)
    for k in range(6):
        add_for(policy, "greedy", k, f"greedy {k}.")
    served = []
    for _ in range(2):
        batch = policy.schedule(LATER)
        served += [r.text for r in batch.add]
        run_step(policy, batch, finished=batch.step)
    add_for(policy, "newcomer", 10, "newcomer.")
    add_for(policy, "newcomer", 11, "newcomer again.")
    for _ in range(4):
        batch = policy.schedule(LATER)
        served += [r.text for r in batch.add]
        run_step(policy, batch, finished=batch.step)
    assert served == ["greedy 0.", "greedy 1.", "newcomer.", "greedy 2.", "newcomer again.", "greedy 3."]
    assert policy.admission().by_client == {"greedy": 2}


def test_one_client_cannot_keep_the_others_out_of_a_full_queue() -> None:
    config = PolicyConfig(max_batch=1, max_queue=4, max_wait_s=0.0)
    policy = SchedulingPolicy(config)
    for k in range(5):
        add_for(policy, "greedy", k, f"greedy {k}.")
    policy.schedule(LATER)  # one runs, four wait: the queue is full
    admission = policy.admission()
    assert admission.waiting == 4 and admission.by_client == {"greedy": 4}
    assert refusal(admission, config, 0, client="greedy") is not None  # alone, refused at max_queue
    assert refusal(admission, config, 0, client="polite") is None  # a newcomer is under its share
    # Its share is max_queue / clients waiting (2 here); a submitted add counts as waiting.
    assert refusal(admission, config, 1, client="polite", pending_by_client={"polite": 1}) is None
    assert refusal(admission, config, 2, client="polite", pending_by_client={"polite": 2}) is not None
    # Never more than twice max_queue in all, whoever asks.
    assert refusal(admission, config, 4, client="third", pending_by_client={"other": 4}) is not None


def test_the_retry_estimate_has_a_floor() -> None:
    assert retry_after_ms(0, batch_limit=16, seconds_per_block=0.001) == 250
    assert retry_after_ms(32, batch_limit=16, seconds_per_block=0.05) == 1500


# --- out of memory -------------------------------------------------------------------------------


def test_out_of_memory_halves_the_batch_and_retries_the_first_half() -> None:
    policy = make_policy(max_batch=8)
    for i in range(8):
        add(policy, i, [f"stream {i}."])
    batch = policy.schedule(LATER)
    assert len(batch.step) == 8
    assert policy.update(batch, OutOfMemory(), LATER) == []
    retry = policy.schedule(LATER)
    assert retry.step == batch.step[:4] and retry.add == ()  # the rest stay paused in the engine
    assert policy.batch_limit == 4


def test_the_batch_limit_grows_back_after_good_steps() -> None:
    policy = make_policy(max_batch=4, oom_recovery_steps=3)
    for i in range(4):
        add(policy, i, [f"stream {i} is long."])
    policy.update(policy.schedule(LATER), OutOfMemory(), LATER)
    assert policy.batch_limit == 2
    for _ in range(3):
        run_step(policy, policy.schedule(LATER))
    assert policy.batch_limit == 3
    assert len(policy.schedule(LATER).step) == 3


def test_out_of_memory_with_one_row_fails_it() -> None:
    policy = make_policy()
    add(policy, 0, ["alone."])
    batch = policy.schedule(LATER)
    assert ended(policy.update(batch, OutOfMemory(), LATER))[0].reason == "error"


# --- the breaker ---------------------------------------------------------------------------------


def test_consecutive_failures_open_the_breaker_and_refuse_new_streams() -> None:
    config = PolicyConfig(breaker_threshold=3, breaker_probe_interval_s=2.0, max_wait_s=0.0)
    policy = SchedulingPolicy(config)
    for i in range(3):
        add(policy, i, ["fails."])
        events = policy.update(policy.schedule(LATER), StepFailed("boom"), LATER)
        assert ended(events)[i].reason == "error"
    assert BreakerChanged(open=True) in events and policy.breaker_open
    assert refusal(policy.admission(), config, pending=0) == 2000
    # Streams that slip in anyway fail at once instead of waiting for nothing.
    assert ended(add(policy, 9, ["late."]))[9].message == BREAKER_MESSAGE


def test_a_good_step_resets_the_failure_count() -> None:
    policy = make_policy(breaker_threshold=2)
    add(policy, 0, ["fails."])
    policy.update(policy.schedule(LATER), StepFailed("boom"), LATER)
    add(policy, 1, ["works and is long."])
    run_step(policy, policy.schedule(LATER))
    add(policy, 2, ["fails."])
    batch = policy.schedule(LATER)
    policy.update(batch, StepFailed("boom"), LATER)
    assert not policy.breaker_open


def test_opening_the_breaker_fails_the_streams_that_wait() -> None:
    policy = make_policy(max_batch=1, breaker_threshold=1)
    add(policy, 0, ["running."])
    add(policy, 1, ["waiting for a slot."])
    batch = policy.schedule(LATER)
    events = policy.update(batch, StepFailed("boom"), LATER)
    assert ended(events)[1].message == BREAKER_MESSAGE  # the waiting one, at once
    assert ended(events)[0].reason == "error"
    assert policy.waiting_count == 0


def test_the_open_breaker_probes_on_time_and_a_good_probe_closes_it() -> None:
    config = PolicyConfig(breaker_threshold=1, breaker_probe_interval_s=2.0, max_wait_s=0.0)
    policy = SchedulingPolicy(config)
    add(policy, 0, ["fails."])
    policy.update(policy.schedule(10.0), StepFailed("boom"), 10.0)
    assert policy.schedule(11.0).wait_until == 12.0  # (and it drops the failed sequence)
    probe = policy.schedule(12.0)
    assert probe.probe
    assert policy.update(probe, Probed(ok=False), 12.5) == []  # still open; next probe 2 s later
    assert policy.schedule(14.0) == Batch(wait_until=14.5)
    probe = policy.schedule(14.5)
    assert policy.update(probe, Probed(ok=True), 14.6) == [BreakerChanged(open=False)]
    assert not policy.breaker_open and refusal(policy.admission(), config, pending=0) is None
    add(policy, 1, ["served again."])
    assert len(policy.schedule(15.0).step) == 1


def test_a_failed_warm_up_opens_the_breaker() -> None:
    policy = make_policy()
    assert policy.open_breaker(0.0) == [BreakerChanged(open=True)]
    assert policy.breaker_open


# --- batching, cancellation, completion ----------------------------------------------------------


def test_an_idle_policy_waits_max_wait_to_gather_a_first_batch() -> None:
    policy = SchedulingPolicy(PolicyConfig(max_batch=4, max_wait_s=0.005))
    policy.add(0, ["one."], PARAMS, input_closed=True, now=1.0)
    assert policy.schedule(1.001) == Batch(wait_until=1.005)
    for i in range(1, 4):  # a full batch does not wait
        policy.add(i, [f"s{i}."], PARAMS, input_closed=True, now=1.002)
    assert len(policy.schedule(1.002).step) == 4


def test_a_newcomer_joins_at_the_next_block_boundary() -> None:
    policy = make_policy(max_batch=32)
    for i in range(16):
        add(policy, i, ["a long running text."])
    first = policy.schedule(LATER)
    run_step(policy, first)
    add(policy, 99, ["newcomer."])
    second = policy.schedule(LATER)
    assert len(second.add) == 1 and len(second.step) == 17


def test_cancel_drops_running_sequences_at_the_next_batch() -> None:
    policy = make_policy()
    add(policy, 0, ["kept."])
    add(policy, 1, ["cancelled."])
    batch = policy.schedule(LATER)
    run_step(policy, batch)
    assert policy.cancel(1) == [Ended(1, "cancelled")]
    following = policy.schedule(LATER)
    assert following.drop == (batch.step[1],) and following.step == (batch.step[0],)
    assert policy.cancel(1) == []  # already gone


def test_an_incremental_stream_completes_only_after_its_input_ends() -> None:
    policy = make_policy()
    assert add(policy, 0, [], closed=False) == []
    assert policy.append(0, "late text.", LATER) == []
    batch = policy.schedule(LATER)
    assert not ended(run_step(policy, batch, finished=batch.step))
    assert policy.end_input(0) == [Ended(0, "complete")]


def test_an_empty_closed_stream_completes_at_once() -> None:
    assert add(make_policy(), 0, []) == [Ended(0, "complete")]


def test_a_refused_sequence_fails_its_stream_only() -> None:
    policy = make_policy()
    add(policy, 0, ["fine."])
    add(policy, 1, ["refused.", "and its look-ahead."])
    batch = policy.schedule(LATER)
    refused = next(r.seq_id for r in batch.add if r.text == "refused.")
    assert ended(policy.refuse(refused))[1].reason == "error"
    assert policy.running(batch.step) == (batch.step[0],)


def test_stop_fails_every_stream() -> None:
    policy = make_policy()
    add(policy, 0, ["one."])
    add(policy, 1, ["two."])
    assert {e.stream_id for e in policy.stop() if e.reason == "error"} == {0, 1}
