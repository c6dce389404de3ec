"""How deeply a JSON text nests, found before any decoder recurses into it.

JSON decoders recurse once per nesting level (msgspec and the standard library alike), so
~20 000 brackets inside the size limit raise ``RecursionError`` instead of a decode error.
Every front end's one JSON decoding path calls :func:`check_nesting` first, so a text that
nests deeper than ``--max-json-depth`` is an ordinary ``bad_request``. The scan is linear:
string literals are cut out with one regular expression (brackets inside them do not
count), then the running depth of what is left is a cumulative sum. Texts with fewer
brackets than the bound (every real message) are passed after two ``count`` calls.
"""

from __future__ import annotations

import re
from typing import Final

import numpy as np

#: A JSON string literal (escapes included), in the unrolled form that never backtracks.
_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: Each byte's step in depth: +1 for ``[`` and ``{``, -1 for ``]`` and ``}``, 0 for the rest.
_STEP: Final = np.zeros(256, dtype=np.int32)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


class TooDeep(ValueError):
    """The text nests deeper than the bound; the message says so (safe to send to a client)."""


def nesting_depth(raw: str | bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (0 for a scalar).

    Meant for valid JSON; for invalid text it may count too deep after the first error,
    which only ever refuses a text the decoder would refuse anyway.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    bare = _STRING.sub(b"", data)
    steps = _STEP[np.frombuffer(bare, dtype=np.uint8)]
    return int(np.cumsum(steps).max(initial=0))


def check_nesting(raw: str | bytes, max_depth: int) -> None:
    """Refuse a JSON text that nests deeper than ``max_depth`` levels.

    Raises:
        TooDeep: naming the bound and its flag.
    """
    opens = raw.count("[") + raw.count("{") if isinstance(raw, str) else raw.count(b"[") + raw.count(b"{")
    if opens <= max_depth:
        return  # cannot nest deeper than it has brackets
    if (depth := nesting_depth(raw)) > max_depth:
        raise TooDeep(f"JSON nested {depth} levels deep; at most {max_depth} (--max-json-depth)")
