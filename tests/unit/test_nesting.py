"""JSON nesting depth, found without recursion (server.frontends.nesting)."""

from __future__ import annotations

import json
import re

import pytest

from server.frontends.nesting import TooDeep, check_nesting, nesting_depth


@pytest.mark.parametrize(
    ("value", "depth"),
    [
        (1, 0),
        ("[[[not brackets]]]", 0),
        ([], 1),
        ({"a": [1, {"b": []}]}, 4),
        ({"text": 'quotes \\" and [brackets] in "strings"', "x": [[[]]]}, 4),
        ([[[[[[[[[[]]]]]]]]]], 10),
    ],
)
def test_the_depth_is_that_of_the_structure_not_of_the_strings(value: object, depth: int) -> None:
    raw = json.dumps(value)
    assert nesting_depth(raw) == depth
    assert nesting_depth(raw.encode()) == depth


def test_a_text_deeper_than_the_bound_is_refused_and_one_at_it_passes() -> None:
    check_nesting(json.dumps([[[[]]]]), 4)
    with pytest.raises(TooDeep, match=re.escape("nested 5 levels deep; at most 4 (--max-json-depth)")):
        check_nesting(json.dumps([[[[[]]]]]), 4)


def test_twenty_thousand_levels_are_measured_without_recursion() -> None:
    raw = '{"type": "start", "x": ' + "[" * 20_000 + "]" * 20_000 + "}"
    assert nesting_depth(raw) == 20_001
    with pytest.raises(TooDeep):
        check_nesting(raw, 32)


def test_many_brackets_inside_strings_pass() -> None:
    raw = json.dumps({"text": "[laugh]" * 5000 + "[[[[" * 100})
    check_nesting(raw, 1)


def test_non_ascii_text_counts_the_same() -> None:
    assert nesting_depth(json.dumps({"text": "你好 [uv_break]"}, ensure_ascii=False)) == 1
