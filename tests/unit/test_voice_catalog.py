"""The voice catalog every port resolves and lists names through, over a real service and fake engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.engine.fake import FAKE_VOICES
from server.errors import UnknownVoice
from server.streams.service import SpeechService
from server.voices.catalog import ECHOED_CHARS, LISTED_RECORDINGS, OPENAI_VOICES, canonical
from tests.integration.test_voices import TRANSCRIPT, encoded, recording
from tests.unit.conftest import MakeService

BUILTIN = ", ".join([*FAKE_VOICES, *OPENAI_VOICES, "seed:<int>"])


async def with_recordings(
    make_service: MakeService, tmp_path: Path, count: int, owner: str | None = None
) -> tuple[SpeechService, list[str]]:
    service: SpeechService = await make_service("--voices-dir", str(tmp_path))
    await service.voices.load(service.engine.info.voice_encoder)
    ids = []
    for n in range(count):
        voice = await service.voices.create(encoded(recording(seed=n)), TRANSCRIPT, owner=owner)
        ids.append(voice.id)
    return service, ids


def test_openai_names_are_fixed_chattts_voices() -> None:
    assert (
        canonical("alloy") == "default" and canonical("echo") == "seed:14" and canonical("cedar") == "seed:22"
    )
    assert canonical("seed:3") == "seed:3" and canonical("voice_0123456789abcdef") == "voice_0123456789abcdef"
    assert len(set(OPENAI_VOICES.values())) == len(OPENAI_VOICES)  # no two names are one voice


async def test_names_resolve_to_the_engines_voices_or_a_recording(
    make_service: MakeService, tmp_path: Path
) -> None:
    service, [recorded] = await with_recordings(make_service, tmp_path, 1)
    catalog = service.catalog
    assert catalog.names() == (*FAKE_VOICES, *OPENAI_VOICES, recorded)
    assert catalog.resolve("nova") == ("seed:16", None)
    assert catalog.resolve("tenor") == ("tenor", None)
    assert catalog.resolve("seed:77") == ("seed:77", None)  # a pattern the engine accepts, not listed
    voice, stored = catalog.resolve(recorded)
    assert voice == recorded and stored is not None and stored.id == recorded


async def test_an_unknown_name_lists_the_valid_ones(make_service: MakeService, tmp_path: Path) -> None:
    service, ids = await with_recordings(make_service, tmp_path, 2)
    with pytest.raises(UnknownVoice) as refused:
        service.catalog.resolve("robot")
    assert (
        str(refused.value)
        == f"unknown voice 'robot'; use one of {BUILTIN}, or a voice from a recording: {', '.join(ids)}"
    )
    assert refused.value.message == str(refused.value)


async def test_many_recordings_are_counted_not_listed(make_service: MakeService, tmp_path: Path) -> None:
    service, ids = await with_recordings(make_service, tmp_path, LISTED_RECORDINGS + 1)
    message = service.catalog.unknown("robot").message
    assert f"use one of {BUILTIN}, or one of {len(ids)} voices from recordings" in message
    assert "GET /v1/audio/voices" in message and not any(i in message for i in ids)


async def test_a_long_unknown_name_is_not_echoed_whole(make_service: MakeService) -> None:
    service: SpeechService = await make_service()
    name = "x" * 5000
    message = service.catalog.unknown(name).message
    assert "x" * ECHOED_CHARS + "…" in message and "x" * (ECHOED_CHARS + 1) not in message


async def test_another_tenants_recording_is_neither_listed_nor_resolved(
    make_service: MakeService, tmp_path: Path
) -> None:
    service, [theirs] = await with_recordings(make_service, tmp_path, 1, owner="tenant:acme")
    assert theirs in service.catalog.names("tenant:acme")
    assert theirs not in service.catalog.names("tenant:bob")
    with pytest.raises(UnknownVoice) as refused:
        service.catalog.resolve(theirs, "tenant:bob")
    assert "from a recording" not in refused.value.message  # bob has none to be told of
