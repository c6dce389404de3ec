"""README's "Already using ElevenLabs?" example, run as written against a test server."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
from pipecat.frames.frames import TTSAudioRawFrame, TTSTextFrame
from pipecat.tests.utils import SleepFrame, run_test

from tests.integration.test_incremental import ANSWER
from tests.integration.test_pipecat import llm_answer
from tests.wsclient import stream_payload

README = Path(__file__).resolve().parents[2] / "README.md"


def example() -> str:
    """The Python block of the section, as written."""
    section = README.read_text(encoding="utf-8").split("## Already using ElevenLabs?", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


async def test_the_readme_example_speaks_through_both_frameworks(make_app: Any) -> None:
    app = await make_app("--elevenlabs-seed", "6")
    code = example().replace("127.0.0.1:8081", f"127.0.0.1:{app.http_port}")  # the test server's port
    names: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        exec(compile(code, "README.md", "exec"), names)
        livekit_tts, pipecat_tts = names["livekit_tts"], names["pipecat_tts"]
        livekit_tts._session = session  # LiveKit takes its HTTP session from a job context, else this
        stream = livekit_tts.stream()
        stream.push_text(ANSWER)
        stream.end_input()
        lk_audio = b"".join([event.frame.data.tobytes() async for event in stream])
        await livekit_tts.aclose()
    down, _ = await run_test(pipecat_tts, frames_to_send=[*llm_answer(ANSWER), SleepFrame(1.0)])
    pc_audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    reference = await stream_payload(app.port, text=ANSWER, seed=6)
    assert pc_audio == reference and [f for f in down if isinstance(f, TTSTextFrame)]
    assert len(lk_audio) > 0
