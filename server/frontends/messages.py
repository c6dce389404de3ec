"""The one way every front end reads a client's JSON and numbers, and counts its invalid messages.

Each front end (the WebSocket's messages, the OpenAI and ElevenLabs REST bodies, the ElevenLabs
WebSocket's messages, Wyoming's events) decodes through :func:`decode`, in this order:

1. the nesting bound (:func:`server.frontends.nesting.check_nesting`, ``--max-json-depth``),
   before any decoder recurses into the text;
2. the number bound (:func:`check_numbers`): a number's integer part or exponent may have at
   most :data:`MAX_NUMBER_DIGITS` digits (every 64-bit integer fits), so a 5000-digit integer
   is refused before Python builds it (or refuses it past ``sys.int_max_str_digits`` with a
   ``ValueError``), and no integer reaches ``float()`` big enough to overflow it;
3. msgspec, typed where the front end has a type: strict JSON only (no ``NaN``/``Infinity``),
   and a float that overflows (``1e400``) is refused, never an ``inf``.

Every refusal is a :class:`BadMessage` whose text is safe to send and names the field when
msgspec knows it. :func:`convert` holds a value already decoded (an ElevenLabs message's
``voice_settings``) to a type the same way, :func:`query_int` reads an integer query parameter
within its range (ASCII digits only: ``str.isdigit`` takes ``'²'``), and
:class:`InvalidBudget` is ``--invalid-messages-per-s``: a connection past it is closed with
1008, on every WebSocket front end.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

from server.frontends.nesting import TooDeep, check_nesting
from server.streams.limits import TokenBucket

T = TypeVar("T")

#: Digits a number's integer part (or exponent) may have: 2^64 - 1 has 20.
MAX_NUMBER_DIGITS: Final = 20
#: The WebSocket close code and reason past ``--invalid-messages-per-s`` (as on ``/v1/stream``).
INVALID_CLOSE_CODE: Final = 1008
INVALID_CLOSE_REASON: Final = "too many invalid messages"
#: Refusals that are the message's fault, counted against ``--invalid-messages-per-s``; the
#: others (``overloaded``, ``resume_expired``, ``shutting_down``, ``internal``) are the server's.
INVALID_CODES: Final = frozenset(
    {"bad_request", "text_too_long", "unsupported", "duplicate_id", "too_many_streams", "unknown_stream"}
    | {"rate_limited"}  # a client that ignores retry_after_ms
)

#: A run of digits longer than the bound, anywhere (strings included): the fast first look.
_LONG_RUN: Final = re.compile(rf"\d{{{MAX_NUMBER_DIGITS + 1}}}")
_LONG_RUN_BYTES: Final = re.compile(rf"\d{{{MAX_NUMBER_DIGITS + 1}}}".encode())
#: A JSON string literal (escapes included), in the unrolled form that never backtracks.
_STRING: Final = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: A JSON number: its integer part and its exponent's digits.
_NUMBER: Final = re.compile(r"-?(\d+)(?:\.\d+)?(?:[eE][+-]?(\d+))?")
#: Where msgspec says the problem is: ``- at `$.voice_settings.speed```.
_PATH: Final = re.compile(r"- at `(\$[^`]*)`")
#: msgspec's words for a number it cannot hold (a float past ±1.8e308, an integer past its range).
_OUT_OF_RANGE: Final = ("Number out of range", "Integer value out of range")
NUMBER_RULE: Final = (
    f"JSON numbers must be finite, with at most {MAX_NUMBER_DIGITS} digits before the point "
    "and in the exponent"
)


class BadMessage(ValueError):
    """A client's JSON that is refused; :attr:`message` is safe to send.

    Attributes:
        message: what is wrong, naming the field (``$.speed``) when known.
        path: the field's path as msgspec writes it (``$.voice_settings.speed``), if known.
        validation: msgspec's own text when the JSON was well formed but of the wrong shape
            (a front end may word that in its own terms); None for malformed JSON and limits.
    """

    def __init__(self, message: str, *, path: str | None = None, validation: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.validation = validation

    @property
    def field(self) -> str | None:
        """The top-level field the problem is in (``speed`` for ``$.speed``), if known."""
        if self.path is None or not self.path.startswith("$."):
            return None
        return re.split(r"[.\[]", self.path[2:], maxsplit=1)[0] or None


def check_numbers(raw: str | bytes) -> None:
    """Refuse a JSON text with a number of more than :data:`MAX_NUMBER_DIGITS` digits.

    Linear, and almost free for real messages: unless some run of digits (in a string or
    not) is longer than the bound, nothing more is done. Digits inside strings do not count.

    Raises:
        BadMessage: naming the number's first digits and the rule.
    """
    if isinstance(raw, bytes):
        if _LONG_RUN_BYTES.search(raw) is None:
            return
        text = raw.decode("utf-8", "replace")
    else:
        if _LONG_RUN.search(raw) is None:
            return
        text = raw
    bare = _STRING.sub('""', text)
    for number in _NUMBER.finditer(bare):
        whole, exponent = number.group(1), number.group(2) or ""
        if len(whole) > MAX_NUMBER_DIGITS or len(exponent) > MAX_NUMBER_DIGITS:
            shown = number.group(0)
            shown = shown if len(shown) <= 24 else f"{shown[:20]}… ({len(shown)} characters)"
            raise BadMessage(f"number {shown} is out of range: {NUMBER_RULE}")


def decode(raw: str | bytes, decoder: msgspec.json.Decoder[T], *, max_depth: int) -> T:
    """``raw`` decoded by ``decoder`` within the nesting and number bounds.

    Raises:
        BadMessage: too deep, a number out of range, malformed JSON, or the wrong shape.
    """
    try:
        check_nesting(raw, max_depth)
    except TooDeep as exc:
        raise BadMessage(str(exc)) from None
    check_numbers(raw)
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: never past the nesting check
        raise BadMessage(f"malformed JSON: {exc}") from None


def convert(value: object, kind: type[T], name: str) -> T:
    """A value decoded without a type (``name`` in its message) held to ``kind``.

    Raises:
        BadMessage: the wrong shape, naming ``name`` and the field in it.
    """
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        text = text.replace("`$", f"`$.{name}", 1) if _PATH.search(text) else f"{text} - at `$.{name}`"
        raise _invalid(msgspec.ValidationError(text)) from None


def _invalid(exc: msgspec.ValidationError) -> BadMessage:
    text = str(exc)
    match = _PATH.search(text)
    path = match.group(1) if match else None
    if text.startswith(_OUT_OF_RANGE):
        # A path without a field name (``$[...][...]``, from a decode without a type) says nothing.
        where = f" at `{path}`" if path and not path.startswith("$[") else ""
        return BadMessage(f"number out of range{where}: {NUMBER_RULE}", path=path)
    return BadMessage(f"invalid message: {text}", path=path, validation=text)


def query_int(query: Any, name: str, low: int, high: int, *, clamp: bool = False) -> int | None:
    """The integer query parameter ``name`` (None when absent), within ``low``..``high``.

    Only ASCII digits count (``str.isdigit`` and ``int`` take ``'²'`` and other scripts'
    digits), at most as many as ``high`` has, so no text can make a huge ``int``.

    Args:
        query: the request's query (a mapping of parameter to text).
        name: the parameter.
        low: the least value.
        high: the greatest value.
        clamp: bring an integer outside the range into it instead of refusing it.

    Raises:
        BadMessage: not an integer, or outside the range (and not ``clamp``).
    """
    text = query.get(name)
    if text is None:
        return None
    significant = text.lstrip("0") or "0"
    if not (text.isascii() and text.isdigit() and len(significant) <= len(str(high))):
        if clamp and text.isascii() and text.isdigit():
            return high  # more digits than the greatest value has: above it
        raise BadMessage(f"query parameter {name} must be an integer from {low} to {high}, not {text[:40]!r}")
    value = int(significant)
    if clamp:
        return min(high, max(low, value))
    if not low <= value <= high:
        raise BadMessage(f"query parameter {name} must be an integer from {low} to {high}, not {value}")
    return value


class InvalidBudget:
    """``--invalid-messages-per-s`` for one connection: that many at once, refilled at that rate.

    Args:
        rate: invalid messages per second (and the burst); 0 or less: unlimited.
        clock: the monotonic clock (tests pass their own).
    """

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._bucket = TokenBucket(rate, rate, rate, clock()) if rate > 0 else None

    def spend(self, code: str) -> bool:
        """A refusal with wire ``code`` was sent; True once the connection is past its budget.

        Only codes in :data:`INVALID_CODES` (the message's fault) are counted.
        """
        if self._bucket is None or code not in INVALID_CODES:
            return False
        return self._bucket.take(self._clock()) > 0
