"""Voices from recordings through the real HTTP port, against the fake engine.

Upload (multipart, and OpenAI's ``client.audio.voices.create``), speak with the voice on the
WebSocket and the OpenAI endpoint, list, delete; every bad upload answered 400 with its
reason; the folder's bounds; a restart (a new ``App`` over the same ``--voices-dir``) keeps the
voices; nothing half-written is ever left. The tiny ChatTTS model does the same in
``tests/model/test_voices_server.py``.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import soundfile
from openai import AsyncOpenAI

from server.app import App
from server.engine.fake import FAKE_VOICE_ENCODER
from server.engine_api import VoiceSample
from tests.integration.test_http_speech import assert_openai_error, base_url
from tests.integration.test_refine import expected
from tests.wsclient import collect, open_client, start

TEXT = "用我的声音说这句话。And this one too."
TRANSCRIPT = "这是一段参考录音。"


def recording(
    seconds: float = 2.0, rate: int = 24_000, *, amplitude: float = 0.3, seed: int = 0
) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (amplitude * np.sin(2 * np.pi * 180 * t) + 0.02 * amplitude * noise).astype(np.float32)


def encoded(audio: np.ndarray, rate: int = 24_000, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, audio, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def form(audio: bytes | None, transcript: str | None = TRANSCRIPT, **fields: str) -> aiohttp.FormData:
    data = aiohttp.FormData()
    if audio is not None:
        data.add_field("audio_sample", audio, filename="me.wav", content_type="audio/wav")
    if transcript is not None:
        data.add_field("transcript", transcript)
    for name, value in fields.items():
        data.add_field(name, value)
    return data


async def upload(app: App, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base_url(app)}/audio/voices", data=body, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


async def delete(app: App, voice_id: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.delete(f"{base_url(app)}/audio/voices/{voice_id}") as resp,
    ):
        return resp.status, await resp.json()


async def listed(app: App) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(f"{base_url(app)}/audio/voices") as resp:
        assert resp.status == 200
        return {entry["id"]: entry for entry in (await resp.json())["data"]}


def expected_pcm(text: str, voice: str, sample: VoiceSample | None, seed: int) -> bytes:
    """The fake engine's stream of ``text`` in ``voice`` (from its definition of audio)."""
    return expected(text, seed, voice=voice, reference=sample)


async def ws_stream(app: App, **fields: Any) -> Any:
    ws, _ = await open_client(app.port)
    await start(ws, id="v", **fields)
    log = (await collect(ws, {"v"}))["v"]
    await ws.close()
    return log


def folder_files(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.is_dir() else []


# --- the whole round trip ----------------------------------------------------------------------


async def test_upload_speak_list_delete(make_app: Any, tmp_path: Path) -> None:
    app = await make_app("--voices-dir", str(tmp_path))
    status, voice = await upload(app, form(encoded(recording()), name="grandma"))
    assert status == 200, voice
    assert voice["object"] == "audio.voice" and voice["type"] == "audio_sample"
    assert voice["id"].startswith("voice_") and voice["name"] == "grandma"
    assert voice["transcript"] == TRANSCRIPT and abs(voice["seconds"] - 2.0) < 0.01
    voice_id = voice["id"]
    assert [p.name for p in folder_files(tmp_path)] == [f"{voice_id}.json"]

    # Listed with the built-in voices, and in every new connection's hello.
    voices = await listed(app)
    assert {"alloy", "default", voice_id} <= set(voices)
    assert voices[voice_id]["name"] == "grandma" and voices[voice_id]["voice"] == voice_id
    _, hello = await open_client(app.port)
    assert hello["voices"][-1] == voice_id and "default" in hello["voices"]

    # Spoken on the WebSocket: the stream carries the recording's codes and transcript.
    sample = app.service.voices.get(voice_id)
    assert sample is not None
    log = await ws_stream(app, text=TEXT, voice=voice_id, seed=5)
    assert log.done["reason"] == "complete"
    assert log.payload == expected_pcm(TEXT, voice_id, sample.sample, 5)
    assert log.payload != expected_pcm(TEXT, voice_id, None, 5)  # the recording changed the audio

    # And on the OpenAI endpoint, by the id or as {"id": ...}.
    async with AsyncOpenAI(base_url=base_url(app), api_key="x", max_retries=0) as oai:
        speech = await oai.audio.speech.create(
            model="tts-1", voice=voice_id, input=TEXT, response_format="pcm", extra_body={"seed": 5}
        )
    assert speech.content == log.payload

    status, gone = await delete(app, voice_id)
    assert (status, gone) == (200, {"id": voice_id, "object": "audio.voice.deleted", "deleted": True})
    assert folder_files(tmp_path) == []
    assert voice_id not in await listed(app)
    log = await ws_stream(app, text=TEXT, voice=voice_id)
    assert log.errors[0]["code"] == "unsupported" and voice_id in log.errors[0]["message"]
    status, again = await delete(app, voice_id)
    assert_openai_error(status, again, "not_found", None, expected_status=404)


async def test_the_openai_client_creates_and_deletes_voices(make_app: Any, tmp_path: Path) -> None:
    app = await make_app("--voices-dir", str(tmp_path))
    async with AsyncOpenAI(base_url=base_url(app), api_key="x", max_retries=0) as oai:
        voice = await oai.audio.voices.create(
            name="me",
            audio_sample=("me.flac", encoded(recording(), fmt="FLAC"), "audio/flac"),
            consent="cons_ignored",
            extra_body={"transcript": TRANSCRIPT},
        )
        assert voice.object == "audio.voice" and voice.name == "me" and voice.type == "audio_sample"
        speech = await oai.audio.speech.create(
            model="tts-1", voice={"id": voice.id}, input="Hello.", response_format="pcm"
        )
        assert len(speech.content) > 0
        deleted = await oai.audio.voices.delete(voice.id)
        assert deleted.deleted and deleted.id == voice.id


async def test_deleting_a_voice_leaves_its_running_streams_alone(make_app: Any, tmp_path: Path) -> None:
    app = await make_app("--voices-dir", str(tmp_path), "--fake-step-ms", "20")
    _, voice = await upload(app, form(encoded(recording())))
    sample = app.service.voices.get(voice["id"])
    assert sample is not None
    long_text = "第一句话很长很长很长很长。" * 4
    ws, _ = await open_client(app.port)
    await start(ws, id="v", text=long_text, voice=voice["id"], seed=2)
    assert (await delete(app, voice["id"]))[0] == 200
    log = (await collect(ws, {"v"}))["v"]
    await ws.close()
    assert log.done["reason"] == "complete"
    assert log.payload == expected_pcm(long_text, voice["id"], sample.sample, 2)


# --- bad uploads: 400 with the reason, nothing stored ------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        (lambda: form(encoded(recording(11.0))), "audio_sample", "11.0 s long; at most 10 s"),
        (lambda: form(encoded(recording(0.5))), "audio_sample", "at least 1 s"),
        (lambda: form(encoded(np.zeros(48_000, np.float32))), "audio_sample", "silent"),
        (lambda: form(encoded(recording(2.0, 4_000), 4_000)), "audio_sample", "sample rate 4000 Hz"),
        (lambda: form(b"this is not audio at all" * 100), "audio_sample", "not a recording that can be read"),
        (lambda: form(b""), "audio_sample", "not a recording that can be read"),
        (lambda: form(None), "audio_sample", "missing the recording"),
        (lambda: form(encoded(recording()), transcript=None), "transcript", "missing the transcript"),
        (lambda: form(encoded(recording()), transcript="  "), "transcript", "transcript is empty"),
        (lambda: form(encoded(recording()), transcript="…!?"), "transcript", "nothing to speak"),
        (
            lambda: form(encoded(recording()), transcript="我 [foo] 说"),
            "transcript",
            "unknown control tag [foo]",
        ),
        (lambda: form(encoded(recording()), transcript="字" * 201), "transcript", "at most 200"),
        (lambda: form(encoded(recording()), type="prompt"), "type", "type audio_sample"),
        (lambda: json.dumps({"audio_sample": "x", "transcript": "y"}), "audio_sample", "multipart/form-data"),
    ],
)
async def test_bad_uploads_are_refused_with_the_reason(
    make_app: Any, tmp_path: Path, body: Any, param: str, reason: str
) -> None:
    app = await make_app("--voices-dir", str(tmp_path))
    status, answer = await upload(app, body())
    code = "unsupported" if param == "type" else "bad_request"
    assert_openai_error(status, answer, code, param)
    assert reason in answer["error"]["message"], answer
    assert folder_files(tmp_path) == []
    assert app.service.voices.all() == []


async def test_an_upload_over_its_byte_limit_is_413(make_app: Any, tmp_path: Path) -> None:
    app = await make_app("--voices-dir", str(tmp_path), "--voice-upload-max-bytes", "50000")
    status, answer = await upload(app, form(encoded(recording(2.0))))  # 96 kB of WAV
    assert_openai_error(status, answer, "bad_request", "audio_sample", expected_status=413)
    assert "--voice-upload-max-bytes" in answer["error"]["message"]
    assert folder_files(tmp_path) == []


async def test_voice_uploads_can_be_off(make_app: Any, tmp_path: Path) -> None:
    app = await make_app("--voices-dir", str(tmp_path), "--voice-max-seconds", "0")
    status, answer = await upload(app, form(encoded(recording())))
    assert_openai_error(status, answer, "unsupported", None)
    assert "--voice-max-seconds 0" in answer["error"]["message"]


# --- bounds, restart, atomic writes ---------------------------------------------------------------


async def test_the_folder_never_exceeds_its_count_bound(make_app: Any, tmp_path: Path) -> None:
    app = await make_app("--voices-dir", str(tmp_path), "--voices-max", "2")
    ids = []
    for seed in range(2):
        status, voice = await upload(app, form(encoded(recording(seed=seed))))
        assert status == 200
        ids.append(voice["id"])
    status, answer = await upload(app, form(encoded(recording(seed=9))))
    assert_openai_error(status, answer, "limit_reached", None, expected_status=409)
    assert "--voices-max 2" in answer["error"]["message"] and "DELETE" in answer["error"]["message"]
    assert len(folder_files(tmp_path)) == 2
    assert (await delete(app, ids[0]))[0] == 200
    assert (await upload(app, form(encoded(recording(seed=9)))))[0] == 200
    assert len(folder_files(tmp_path)) == 2


async def test_the_folder_never_exceeds_its_byte_bound(make_app: Any, tmp_path: Path) -> None:
    probe = await make_app("--voices-dir", str(tmp_path / "probe"))
    _, voice = await upload(probe, form(encoded(recording())))
    one = (tmp_path / "probe" / f"{voice['id']}.json").stat().st_size
    bound = int(2.5 * one)
    app = await make_app("--voices-dir", str(tmp_path / "voices"), "--voices-max-bytes", str(bound))
    statuses = [(await upload(app, form(encoded(recording(seed=s)))))[0] for s in range(4)]
    assert statuses == [200, 200, 409, 409]
    assert sum(p.stat().st_size for p in folder_files(tmp_path / "voices")) <= bound


async def test_a_restart_keeps_the_voices_its_weights_made(
    make_app: Any, tmp_path: Path, caplog: Any
) -> None:
    first = await make_app("--voices-dir", str(tmp_path))
    _, voice = await upload(first, form(encoded(recording()), name="kept"))
    before = await ws_stream(first, text=TEXT, voice=voice["id"], seed=3)
    await first.stop()
    # Left by other weights, by a crash mid-write, and a damaged file: skipped or cleaned up.
    other = json.loads((tmp_path / f"{voice['id']}.json").read_text())
    other.update(id="voice_00000000000000aa", encoder="sha256:other-weights")
    (tmp_path / "voice_00000000000000aa.json").write_text(json.dumps(other))
    (tmp_path / ".voice_00000000000000bb.1234.tmp").write_bytes(b"half a vo")
    (tmp_path / "voice_00000000000000cc.json").write_text("{not json")

    second = await make_app("--voices-dir", str(tmp_path))
    voices = await listed(second)
    assert voices[voice["id"]]["name"] == "kept"
    assert "voice_00000000000000aa" not in voices and "voice_00000000000000cc" not in voices
    assert any(
        "made by other weights" in r.getMessage() and FAKE_VOICE_ENCODER in r.getMessage()
        for r in caplog.records
    )
    assert not (tmp_path / ".voice_00000000000000bb.1234.tmp").exists()
    after = await ws_stream(second, text=TEXT, voice=voice["id"], seed=3)
    assert after.payload == before.payload
    # The skipped files still count towards the folder's bound (it is the folder's).
    assert second.service.voices.store.count == 3


async def test_a_failed_write_leaves_nothing_behind(
    make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = await make_app("--voices-dir", str(tmp_path))

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    status, answer = await upload(app, form(encoded(recording())))
    assert_openai_error(status, answer, "internal", None, expected_status=500)
    assert "No space left on device" in answer["error"]["message"]
    assert folder_files(tmp_path) == []  # not the voice, not its temporary file
    assert app.service.voices.all() == []
    monkeypatch.undo()
    assert (await upload(app, form(encoded(recording()))))[0] == 200


# --- the same gate and limits as speech ---------------------------------------------------------


async def test_uploads_need_the_api_key_and_count_against_the_rate_limit(
    make_app: Any, tmp_path: Path
) -> None:
    app = await make_app(
        "--voices-dir",
        str(tmp_path),
        "--api-keys",
        "k1",
        "--rate-limit-per-min",
        "6",
        "--rate-limit-burst",
        "1",
    )
    status, answer = await upload(app, form(encoded(recording())))
    assert_openai_error(status, answer, "invalid_api_key", None, expected_status=401)
    key = {"Authorization": "Bearer k1"}
    assert (await upload(app, form(encoded(recording())), key))[0] == 200
    status, answer = await upload(app, form(encoded(recording())), key)
    assert_openai_error(status, answer, "rate_limited", None, expected_status=429)
    assert len(folder_files(tmp_path)) == 1


async def test_uploads_are_refused_while_draining(make_app: Any, tmp_path: Path) -> None:
    app = await make_app("--voices-dir", str(tmp_path))
    app.service.draining = True
    status, answer = await upload(app, form(encoded(recording())))
    assert_openai_error(status, answer, "shutting_down", None, expected_status=503)
