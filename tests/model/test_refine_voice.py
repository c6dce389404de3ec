"""Phase-2 groundwork at engine level: ChatTTS's refinement pass and voices from a recording.

Both are held equal to ChatTTS 0.2.5's own code on the tiny checkpoint (float32, near-greedy):
``Chat._refine_text`` / ``infer(refine_text_only=True)`` for the refinement, and
``sample_audio_speaker`` + ``infer(params_infer_code=InferCodeParams(spk_smp=..., txt_smp=...))``
for a voice from a recording.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from server.engine.chattts.refine import RefineParams, TextRefineJob, TextRefiner
from server.text.normalize import speakable
from tests.model.test_native_equivalence import NEAR_GREEDY, NativeChat, _compare

TEXTS = [
    "你好，欢迎使用语音服务。",
    "Hello there, short.",
    "一段更长的文字，用来检查左边的填充是否正确，好的。",
]
PROMPT = "[oral_2][laugh_0][break_6]"


@pytest.fixture(scope="module")
def native(tiny_model_dir: Path) -> NativeChat:
    return NativeChat(tiny_model_dir)


@pytest.fixture(scope="module")
def refiner(tiny_engine: Any) -> TextRefiner:
    return TextRefiner(tiny_engine._chat, device=tiny_engine.device)


def test_refinement_equals_chattts_refine_text_batched(refiner: TextRefiner, native: NativeChat) -> None:
    """Three texts of different lengths in one left-padded batch: the same tokens as ChatTTS."""
    params = native.chat.RefineTextParams(
        prompt=PROMPT, temperature=NEAR_GREEDY, max_new_token=40, show_tqdm=False
    )
    expected = native.chat._refine_text(list(TEXTS), torch.device("cpu"), params).ids
    got = refiner.refine_ids(TEXTS, RefineParams(prompt=PROMPT, temperature=NEAR_GREEDY, max_new_tokens=40))
    assert len(got) == len(expected) == 3
    for ours, theirs in zip(got, expected, strict=True):
        assert len(ours) >= 8
        assert torch.equal(ours, theirs.long())


def test_refined_text_is_what_infer_hands_to_speech(
    tiny_engine: Any, refiner: TextRefiner, native: NativeChat
) -> None:
    """``infer(refine_text_only=True)``: normalize, refine, drop [break_0]+ tokens, decode."""
    raw = ["Refine 3 words!", "精炼这一句话[uv_break]，好吗？"]
    params = native.chat.RefineTextParams(
        prompt=PROMPT, temperature=NEAR_GREEDY, max_new_token=30, show_tqdm=False
    )
    expected = native.chat.infer(
        [speakable(t) for t in raw],
        skip_refine_text=False,
        refine_text_only=True,
        split_text=False,
        params_refine_text=params,
    )
    model_texts = [tiny_engine.text.model_text(t) for t in raw]
    got = refiner.refine(model_texts, RefineParams(prompt=PROMPT, temperature=NEAR_GREEDY, max_new_tokens=30))
    assert got == expected
    assert all(text.strip() for text in got)


def test_refined_numbered_tags_are_dropped_like_infer_does(
    refiner: TextRefiner, tiny_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``infer`` keeps refined tokens below ``[break_0]`` only: word-level tags stay, numbered ones go."""
    tokenizer = tiny_engine._chat.tokenizer._tokenizer
    tokens = ["你", "[uv_break]", "[break_3]", "好", "[laugh]", "[oral_2]", "[speed_5]", "[laugh_1]"]
    ids = torch.tensor(tokenizer.convert_tokens_to_ids(tokens))
    monkeypatch.setattr(TextRefineJob, "ids", lambda self: [ids])
    [text] = refiner.refine(["x"], RefineParams(max_new_tokens=2))
    assert text.split() == ["你", "[uv_break]", "好", "[laugh]"]


def test_seeded_refinement_is_reproducible_and_independent_of_its_batch(refiner: TextRefiner) -> None:
    params = RefineParams(prompt=PROMPT, max_new_tokens=24, seed=5)  # ChatTTS's sampling defaults
    alone = refiner.refine_ids(TEXTS[:1], params)[0]
    assert torch.equal(alone, refiner.refine_ids(TEXTS[:1], params)[0])
    in_batch = refiner.refine_ids(TEXTS, params)[0]  # row 0 keeps seed 5; padding differs
    assert torch.equal(alone, in_batch)
    other_seed = refiner.refine_ids(TEXTS[:1], RefineParams(prompt=PROMPT, max_new_tokens=24, seed=6))[0]
    assert not torch.equal(alone, other_seed)


# --- voices from a recording ------------------------------------------------------------------


def recording(seconds: float = 2.0, rate: int = 24_000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    gen = np.random.default_rng(0)
    voice = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (voice + 0.02 * gen.standard_normal(len(t))).astype(np.float32)


@pytest.mark.parametrize(
    ("samples", "rate", "reason"),
    [
        (recording(31.0), 24_000, "at most 30 s"),
        (recording(0.5), 24_000, "at least 1 s"),
        (np.zeros(48_000, np.float32), 24_000, "silent"),
        (np.full(48_000, np.nan, np.float32), 24_000, "NaN"),
        (recording(2.0), 4_000, "sample rate 4000 Hz"),
        (recording(2.0).reshape(2, 2, -1), 24_000, "mono or multi-channel"),
    ],
)
def test_bad_recordings_are_refused_with_the_reason(samples: np.ndarray, rate: int, reason: str) -> None:
    from server.voices.recording import ReferenceAudioError, check_reference_audio

    with pytest.raises(ReferenceAudioError, match=reason):
        check_reference_audio(samples, rate)


def test_other_rates_and_int16_stereo_become_24k_mono() -> None:
    from server.voices.recording import check_reference_audio

    mono = recording(2.0, 16_000)
    stereo = np.stack([mono, mono], axis=1)
    audio = check_reference_audio((stereo * 32767).astype(np.int16), 16_000)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - 48_000) <= 1


def test_recording_codes_equal_sample_audio_speaker(tiny_engine: Any, native: NativeChat) -> None:
    from server.engine.chattts.reference import ReferenceVoice, encode_reference, reference_codes
    from server.voices.recording import check_reference_audio

    audio = check_reference_audio(recording(), 24_000)
    codes = encode_reference(tiny_engine._chat, audio)
    assert codes.shape[1] == reference_codes(len(audio))
    spk_smp = native.chat.sample_audio_speaker(audio)
    assert codes.shape[0] == 4 and 80 <= codes.shape[1] <= 100  # about 47 codes per second
    voice = ReferenceVoice(codes=codes, transcript="x")
    assert voice.spk_smp == spk_smp
    assert torch.equal(ReferenceVoice.from_spk_smp(spk_smp, "x").codes, codes)


@pytest.mark.parametrize("text", ["你好，这是我的声音。", "Hello, this is my voice [laugh]."])
def test_engine_speaks_in_a_recordings_voice_like_native(
    tiny_engine: Any, native: NativeChat, text: str
) -> None:
    """``infer(spk_smp=..., txt_smp=..., spk_emb=None)``: same prompt, tokens, states, audio.

    The voice travels with the stream (``SynthesisParams.reference``); its transcript goes
    through the same text pipeline as the spoken text.
    """
    from server.engine_api import VoiceSample
    from server.voices.recording import check_reference_audio

    audio = check_reference_audio(recording(), 24_000)
    codes = tiny_engine.encode_voice(audio, "这是一段参考录音，1 2 3。")
    voice = VoiceSample(codes=codes, transcript="这是一段参考录音，1 2 3。")
    _compare(tiny_engine, native, text, "my-voice", 1.0, min_tokens=1, max_tokens=40, reference=voice)
    assert not tiny_engine.validate_voice("my-voice")
