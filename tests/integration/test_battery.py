"""The hostile-client battery, run against every front end (issue #42, acceptance 1).

Each case is written once and parametrized over :data:`tests.integration.battery.FRONT_ENDS`
(the WebSocket, OpenAI's HTTP endpoint, ElevenLabs' WebSocket and REST routes, Wyoming), so a
new front end added to that list inherits every case. Through real sockets against the fake
engine, each case checks three things:

- the hostile request gets a clear answer in its front end's terms (an error code, a close, a
  cut connection), never a 500, a traceback or a hang;
- the server stays up: the attacked front end serves a normal request afterwards, and
  ``chattts_active_streams`` comes back to 0 (nothing held by the attack is leaked);
- a normal client streaming on the WebSocket the whole time gets every stream complete.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from server.app import App
from tests.integration.battery import DEADLINE_S, DEEP, FRONT_ENDS, LONG_TEXT, FrontEnd
from tests.integration.conftest import MakeApp, fake_engine, wait_until
from tests.wsclient import stream_payload

#: Short deadlines so that the slow cases end in seconds; a resume TTL of 1 s so that a dropped
#: WebSocket stream (resumable by design) is freed soon after its client left.
FLAGS = (
    "--header-timeout-s", "1", "--body-timeout-s", "1", "--send-timeout-s", "2",
    "--resume-ttl-s", "1", "--invalid-messages-per-s", "5", "--wyoming-idle-timeout-s", "5",
)  # fmt: skip
#: What a refusal of a malformed request is called on each wire (our code; HTTP's status).
BAD = {"bad_request", "invalid_request", "400"}


def active_streams(app: App) -> float:
    value = app.metrics.registry.get_sample_value("chattts_active_streams")
    return value or 0.0


@contextlib.asynccontextmanager
async def normal_client(app: App) -> AsyncIterator[list[bytes]]:
    """A WebSocket client streaming one request after another for as long as the block runs.

    On leaving, it must have had at least one stream, each complete (``stream_payload``
    fails on an error or a missing ``done``).
    """
    done: list[bytes] = []
    stop = asyncio.Event()

    async def loop() -> None:
        n = 0
        while not stop.is_set() or not done:
            n += 1
            done.append(await stream_payload(app.port, text="Normal speech goes on.", seed=n))

    task = asyncio.create_task(loop())
    try:
        yield done
    finally:
        stop.set()
        async with asyncio.timeout(DEADLINE_S):
            await task
    assert done and all(done)


async def served_and_clean(app: App, front: FrontEnd) -> None:
    """After a case: the front end still serves, and no stream is left behind.

    Both counts must come back to 0: the server's streams (``chattts_active_streams``) and the
    engine's sequences (a stream freed in the gauge but still generating would leak the slot).
    """
    assert await front.speak(app)
    engine = fake_engine(app)
    await wait_until(lambda: active_streams(app) == 0 and engine.live_sequences == 0, timeout=DEADLINE_S)


def fronts() -> list[object]:
    return [pytest.param(front, id=front.name) for front in FRONT_ENDS]


@pytest.fixture
async def battery_app(make_app: MakeApp, request: pytest.FixtureRequest) -> App:
    front: FrontEnd = request.node.callspec.params["front"]
    app: App = await make_app(*FLAGS, *front.flags)
    return app


#: (what, the hostile JSON value, words its refusal must have): each inside the size limit.
HOSTILE = [
    ("20 000 levels deep", DEEP, "--max-json-depth"),
    ("a float that overflows", "1e400", "out of range"),
    ("a negative float that overflows", "-1e400", "out of range"),
    ("a 5000-digit integer", "9" * 5000, "out of range"),
    ("a 25-digit integer", "1" + "0" * 24, "out of range"),
    ("an exponent of 30 digits", "1e" + "0" * 29 + "1", "out of range"),
]


@pytest.mark.parametrize("front", fronts())
@pytest.mark.parametrize(("what", "value", "words"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_json_and_numbers_are_a_clear_refusal(
    battery_app: App, front: FrontEnd, what: str, value: str, words: str
) -> None:
    app = battery_app
    async with normal_client(app):
        for raw in front.number_requests(value):
            answer = await front.exchange(app, raw)
            assert answer.code in BAD, (front.name, what, answer.code, answer.raw[:2])
            # The refusal says what was wrong, and does not quote the input back.
            assert words in answer.message, (front.name, what, answer.message[:200])
            assert len(answer.message) < 400, (front.name, what, answer.message[:100])
    await served_and_clean(app, front)


@pytest.mark.parametrize("front", fronts())
async def test_a_request_sent_a_byte_at_a_time_is_cut(battery_app: App, front: FrontEnd) -> None:
    app = battery_app
    async with normal_client(app):
        answer = await front.trickle(app)  # returns once the server closed (or fails at the deadline)
    assert b" 500 " not in answer[:20]
    await served_and_clean(app, front)


@pytest.mark.parametrize("front", fronts())
async def test_an_invalid_flood_is_answered_and_bounded(battery_app: App, front: FrontEnd) -> None:
    app = battery_app
    async with normal_client(app):
        answer = await front.flood_invalid(app, 300)
    front.check_flood(answer)
    await served_and_clean(app, front)


@pytest.mark.parametrize("front", fronts())
async def test_a_client_that_never_reads_is_bounded(battery_app: App, front: FrontEnd) -> None:
    app = battery_app
    async with normal_client(app):
        await front.never_read(app)
    await served_and_clean(app, front)


@pytest.mark.parametrize("front", fronts())
async def test_a_disconnect_mid_turn_frees_the_stream(battery_app: App, front: FrontEnd) -> None:
    app = battery_app
    async with normal_client(app):
        for polite in (False, True, True):
            await front.leave_mid_turn(app, polite=polite)
    await served_and_clean(app, front)


@pytest.mark.parametrize("front", fronts())
async def test_http_1_0_gets_an_answer_it_can_read(battery_app: App, front: FrontEnd) -> None:
    app = battery_app
    answer = await front.http10(app)
    front.check_http10(answer)
    await served_and_clean(app, front)


@pytest.mark.parametrize("front", fronts())
async def test_start_and_cancel_churn_leaves_nothing_behind(battery_app: App, front: FrontEnd) -> None:
    app = battery_app
    async with normal_client(app):
        for n in range(20):
            await front.leave_mid_turn(app, polite=n % 2 == 0)
            answer = await front.exchange(app, front.request(LONG_TEXT[:200]))
            assert answer.code is None, (front.name, answer.code)
    await served_and_clean(app, front)
