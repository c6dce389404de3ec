"""Voices from recordings on the tiny ChatTTS model behind the real server, over the HTTP port.

Upload a recording → speak with the voice on the WebSocket and the OpenAI endpoint → list →
restart (a new server over the same ``--voices-dir`` and weights) → the same audio → delete.
The codes are made by the model's own DVAE encoder, so the stream's prompt carries
``[empty_spk]``, the transcript and the recording's codes; that this equals ChatTTS's
``infer(spk_smp=..., txt_smp=...)`` is held in ``tests/model/test_refine_voice.py``. Every bad
upload and the folder's bounds are in ``tests/integration/test_voices.py`` (fake engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from server.app import App
from tests.integration.test_http_speech import base_url
from tests.integration.test_voices import delete, encoded, folder_files, form, listed, recording, upload
from tests.wsclient import collect, open_client, start

pytestmark = pytest.mark.loopback  # our own server on 127.0.0.1, nothing else

TEXT = "用我的声音说这句话。"
TRANSCRIPT = "这是一段参考录音。"


async def stream(app: App, **fields: Any) -> Any:
    ws, _ = await open_client(app.port)
    await start(ws, id="v", text=TEXT, seed=3, **fields)
    log = (await collect(ws, {"v"}))["v"]
    await ws.close()
    return log


async def test_a_voice_from_a_recording_round_trip_on_the_model(make_model_app: Any, tmp_path: Path) -> None:
    flags = ("--voices-dir", str(tmp_path), "--voice-max-seconds", "4", "--voices-max", "2")
    app = await make_model_app(*flags)
    status, voice = await upload(app, form(encoded(recording(2.0)), transcript=TRANSCRIPT, name="me"))
    assert status == 200, voice
    voice_id = voice["id"]
    stored = app.service.voices.get(voice_id)
    assert stored is not None and stored.sample.codes.shape[0] == 4  # the DVAE's four code books
    assert 80 <= stored.sample.codes.shape[1] <= 100  # about 47 codes a second

    spoken = await stream(app, voice=voice_id)
    assert spoken.done["reason"] == "complete" and len(spoken.payload) > 0
    default = await stream(app)
    assert spoken.payload != default.payload  # the recording, not the default speaker, conditions it
    async with AsyncOpenAI(base_url=base_url(app), api_key="x", max_retries=0) as oai:
        speech = await oai.audio.speech.create(
            model="tts-1", voice=voice_id, input=TEXT, response_format="pcm", extra_body={"seed": 3}
        )
    assert speech.content == spoken.payload
    assert (await listed(app))[voice_id]["name"] == "me"
    await app.stop()

    again = await make_model_app(*flags)  # a restart: the same folder, the same weights
    assert (await listed(again))[voice_id]["name"] == "me"
    ws, hello = await open_client(again.port)
    await ws.close()
    assert voice_id in hello["voices"]
    assert (await stream(again, voice=voice_id)).payload == spoken.payload

    status, _ = await delete(again, voice_id)
    assert status == 200 and folder_files(tmp_path) == []
    gone = await stream(again, voice=voice_id)
    assert gone.errors[0]["code"] == "unsupported" and voice_id in gone.errors[0]["message"]
