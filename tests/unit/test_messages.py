"""The shared guards every front end goes through: `frontends/messages.py`, `frontends/lifecycle.py`."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from server.frontends.lifecycle import end_connection
from server.frontends.messages import (
    MAX_NUMBER_DIGITS,
    BadMessage,
    InvalidBudget,
    check_numbers,
    convert,
    decode,
    query_int,
)


class Body(msgspec.Struct):
    seed: int | None = None
    speed: float = 1.0
    settings: dict[str, Any] | None = None


typed = msgspec.json.Decoder(Body)
untyped: msgspec.json.Decoder[Any] = msgspec.json.Decoder()


@pytest.mark.parametrize(
    "raw",
    [
        '{"seed": ' + "9" * (MAX_NUMBER_DIGITS + 1) + "}",
        '{"seed": -' + "9" * 5000 + "}",
        '{"speed": 1' + "0" * 400 + ".5}",
        '{"speed": 1e' + "0" * 30 + "4}",
        '{"settings": {"a": [' + "1" * 30 + "]}}",
    ],
)
def test_a_number_with_too_many_digits_is_refused_before_decoding(raw: str) -> None:
    for text in (raw, raw.encode()):
        with pytest.raises(BadMessage) as refused:
            check_numbers(text)
        assert "out of range" in refused.value.message and len(refused.value.message) < 200


@pytest.mark.parametrize(
    "raw",
    [
        '{"seed": 18446744073709551615, "speed": 0.1234567890123456789012345678}',  # 20 digits; long fraction
        '{"token": "' + "7" * 5000 + '"}',  # digits inside a string are text
        '{"key\\"' + "1" * 30 + '": 1}',  # an escaped quote does not end the string
        '{"speed": -1.5e-308}',
    ],
)
def test_numbers_within_the_bound_and_digits_in_strings_pass(raw: str) -> None:
    check_numbers(raw)
    decode(raw, untyped, max_depth=8)


@pytest.mark.parametrize(
    ("raw", "words", "field"),
    [
        ('{"speed": 1e400}', "number out of range at `$.speed`", "speed"),
        ('{"speed": -1e400}', "number out of range at `$.speed`", "speed"),
        ('{"settings": {"x": 1e999}}', "number out of range", "settings"),
        ('{"seed": ' + "[" * 40 + "]" * 40 + "}", "--max-json-depth", None),
        ('{"seed": NaN}', "malformed JSON", None),
        ('{"seed": "5"}', "Expected `int | null`, got `str`", "seed"),
    ],
)
def test_decode_refuses_with_a_clear_message_naming_the_field(
    raw: str, words: str, field: str | None
) -> None:
    with pytest.raises(BadMessage) as refused:
        decode(raw, typed, max_depth=32)
    assert words in refused.value.message and refused.value.field == field


def test_only_a_wrong_shape_carries_msgspec_s_own_words() -> None:
    with pytest.raises(BadMessage) as shape:
        decode('{"seed": true}', typed, max_depth=8)
    with pytest.raises(BadMessage) as limit:
        decode('{"speed": 1e400}', typed, max_depth=8)
    assert shape.value.validation is not None and limit.value.validation is None


def test_convert_names_the_value_it_checks() -> None:
    with pytest.raises(BadMessage) as refused:
        convert({"seed": "x"}, Body, "body")
    assert refused.value.path == "$.body.seed"
    with pytest.raises(BadMessage) as refused:
        convert("x", Body, "body")
    assert refused.value.path == "$.body"


@pytest.mark.parametrize("text", ["²", "١٢", "1.5", "-1", "", " 1", "9" * 5000, "1e3"])
def test_query_int_takes_ascii_digits_within_the_range_only(text: str) -> None:
    with pytest.raises(BadMessage) as refused:
        query_int({"seed": text}, "seed", 0, 2**63 - 1)
    assert "seed" in refused.value.message and len(refused.value.message) < 200


def test_query_int_reads_bounds_and_clamps() -> None:
    assert query_int({}, "seed", 0, 10) is None
    assert query_int({"seed": "0007"}, "seed", 0, 10) == 7
    assert query_int({"seed": "0" * 5000 + "7"}, "seed", 0, 10) == 7
    assert query_int({"t": "0"}, "t", 1, 180, clamp=True) == 1
    assert query_int({"t": "999"}, "t", 1, 180, clamp=True) == 180
    assert query_int({"t": "9" * 5000}, "t", 1, 180, clamp=True) == 180
    with pytest.raises(BadMessage):
        query_int({"t": "²"}, "t", 1, 180, clamp=True)
    with pytest.raises(BadMessage):
        query_int({"seed": "11"}, "seed", 0, 10)


def test_the_invalid_budget_counts_only_the_message_s_faults_and_refills() -> None:
    now = [0.0]
    budget = InvalidBudget(3, clock=lambda: now[0])
    assert not any(budget.spend("overloaded") for _ in range(10))  # the server's, not the client's
    assert [budget.spend("bad_request") for _ in range(4)] == [False, False, False, True]
    now[0] += 1.0  # refilled at 3 a second
    assert not budget.spend("bad_request")
    assert not any(InvalidBudget(0).spend("bad_request") for _ in range(100))  # 0: unlimited


async def test_end_connection_releases_first_and_a_repeated_cancel_skips_nothing() -> None:
    """The handler's ``finally`` is cancelled again while it waits (aiohttp does so): nothing is lost."""
    released: list[str] = []
    stop = asyncio.Event()

    async def pump() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await stop.wait()  # a pump slow to leave keeps the handler waiting
            raise

    pumps = [asyncio.create_task(pump()) for _ in range(2)]
    await asyncio.sleep(0)

    async def handler() -> None:
        try:
            await asyncio.Event().wait()  # the reader
        finally:
            await end_connection(lambda: released.append("streams"), pumps)

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)
    task.cancel()  # the client went away
    await asyncio.sleep(0)
    assert released == ["streams"]  # before the handler waited for anything
    task.cancel()  # and again, while it waits for its pumps
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(p.cancelling() for p in pumps)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*pumps, return_exceptions=True), 5)
    assert all(p.cancelled() for p in pumps)
