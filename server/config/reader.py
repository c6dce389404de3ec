"""Reading the settings: ``serve``'s flags over ``CHATTTS_*`` variables over the defaults.

This is the only module that reads the environment. ``--help`` lists each flag under its topic
(:mod:`server.flag_groups`) with its variable and default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from server.config.settings import ENV_PREFIX, Settings
from server.flag_groups import GROUPS, group_of


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def add_settings_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str], only: Collection[str] | None = None
) -> None:
    """Add one flag per ``Settings`` field (those in ``only``), under its topic; defaults come from ``env``.

    The flags are added topic by topic (``server.flag_groups``), so ``--help`` reads by task.
    """
    fields = {f.name: f for f in dataclasses.fields(Settings) if only is None or f.name in only}
    topics = {name: group_of(name) for name in fields}  # a field without a topic stops here, named
    for topic in GROUPS:
        names = [name for name in topic.fields if name in fields]
        if not names:
            continue
        group = parser.add_argument_group(topic.title, topic.description)
        for name in names:
            assert topics[name] is topic
            _add_setting(parser, group, fields[name], env)


def _add_setting(
    parser: argparse.ArgumentParser,
    group: argparse._ArgumentGroup,
    f: dataclasses.Field[Any],
    env: Mapping[str, str],
) -> None:
    env_name = _env_name(f.name)
    default = f.default
    convert: Any = _parse_bool if isinstance(default, bool) else type(default)
    if env_name in env:
        try:
            default = convert(env[env_name])
        except ValueError as exc:
            parser.error(f"{env_name}: {exc}")
    help_text = f"{f.metadata['help']} [env {env_name}; default: {f.default!r}]"
    flag = "--" + f.name.replace("_", "-")
    if isinstance(f.default, bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
    else:
        group.add_argument(flag, type=convert, default=default, help=help_text, choices=f.metadata["choices"])


def settings_from_namespace(namespace: argparse.Namespace) -> Settings:
    """Build ``Settings`` from parsed arguments (extra attributes are ignored)."""
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(Settings)}
    return Settings(**values)


def load_settings(argv: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Settings:
    """Parse ``serve`` flags from ``argv`` over ``CHATTTS_*`` variables (tests use this)."""
    parser = argparse.ArgumentParser(prog="chattts-stream serve")
    add_settings_arguments(parser, os.environ if env is None else env)
    return settings_from_namespace(parser.parse_args(list(argv)))
