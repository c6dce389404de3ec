"""``chattts-stream serve --help`` lists its flags by topic, every flag under one (server/flag_groups.py)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io

import pytest

from server import cli, flag_groups
from server.config import Settings, load_settings

TOPICS = [
    "Network and protocols",
    "Model and engine",
    "CPU threads",
    "Batching and scheduling",
    "Text, refinement and voices",
    "Audio formats",
    "Limits and memory",
    "Security",
    "Resume, replicas and shutdown",
    "Observability",
    "Development",
]


def serve_parser() -> argparse.ArgumentParser:
    for action in cli._parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("no serve command")


def flags_by_group(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    return {
        str(group.title): [o for a in group._group_actions for o in a.option_strings if o.startswith("--")]
        for group in parser._action_groups
    }


def test_every_serve_flag_is_under_a_topic_and_the_topics_are_in_order() -> None:
    groups = flags_by_group(serve_parser())
    assert [t for t in groups if groups[t]] == ["options", *TOPICS]
    assert groups["options"] == ["--help"]  # argparse's own, and nothing else in the untitled list
    every_setting = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(Settings)}
    listed = [flag for title in TOPICS for flag in groups[title] if not flag.startswith("--no-")]
    assert sorted(listed) == sorted(every_setting)  # each flag once, none missing, no flag renamed


def test_the_help_text_shows_each_topic_with_its_description() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--help"])
    text = out.getvalue()
    assert text.startswith("usage: chattts-stream serve [FLAG ...]\n")  # not ninety flags again
    positions = [text.index(f"\n{title}:\n") for title in TOPICS]
    assert positions == sorted(positions)
    for group in flag_groups.GROUPS:
        first_line = text.split(f"\n{group.title}:\n", 1)[1].splitlines()[0]
        assert first_line.split() == group.description.split()[: len(first_line.split())]
    assert text.index("--max-batch") < text.index("--api-keys ")  # batching before security


def test_the_topics_name_only_settings_each_once() -> None:
    names = [name for group in flag_groups.GROUPS for name in group.fields]
    assert len(names) == len(set(names))
    assert set(names) == {f.name for f in dataclasses.fields(Settings)}


def test_a_setting_without_a_topic_stops_the_parser_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    without = {name: group for name, group in flag_groups._GROUP_OF.items() if name != "max_queue"}
    monkeypatch.setattr(flag_groups, "_GROUP_OF", without)
    with pytest.raises(ValueError, match=r"Settings\.max_queue has no topic .* server/flag_groups\.py"):
        cli._parser()


def test_grouped_flags_parse_and_read_their_variables_as_before() -> None:
    settings = load_settings(["--max-batch", "8", "--no-warmup"], env={"CHATTTS_API_KEYS": "k1,k2"})
    assert (settings.max_batch, settings.warmup, settings.api_keys) == (8, False, "k1,k2")
