"""The light ChatTTS text side (a front end's, with the engine in another process) answers as the engine.

``load_text_side`` loads the tokenizer, the normalizer and the speaker statistics of a model
folder and nothing else; its ``validate_voice`` and ``text_tokens`` must be the loaded engine's,
answer for answer, on texts of every kind (numbers, Chinese, tags, past the budget where the
count is exact) and on voices good and bad. It is loaded here from a copy of the tiny model's
folder without a single weights file: what it answers from cannot be the weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.textside import TextSide, load_text_side
from server.text.normalize import speakable

SHORT_TEXTS = [
    "",
    "Hello there.",
    "It costs $3.50, or 12% off on 2026-01-05 at 10:30.",
    "你好，欢迎使用实时语音合成服务。",
    "会议在下午三点开始，meeting room B.",
    "2026年3月5日，温度是-3.5度。",
    "Pause here [uv_break] and laugh [laugh] then [break_3] stop.",
    "後来，好吗？! (yes); a-b: c",
    "mp3 v2 42nd 1,234,567 0.001",
    "¡Olá! Ça va? Naïve café résumé.",
    "[unknown_tag] brackets [ and ] alone",
    "🙂 emoji and \t tabs \n newlines",
]
#: Past the budget (384 spelled-out characters by default): counted exactly, through the normalizer.
LONG_TEXTS = [
    "The year 1999 and the number 31337 again. " * 12,
    "这是一个很长的句子，用来超过预算。" * 30,
    "Mixed 中文 and English 123 [uv_break] " * 20,
]


@pytest.fixture(scope="module")
def light(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TextSide:
    """The text side from a copy of the tiny model with no weights file in it."""
    folder = tmp_path_factory.mktemp("text-only")
    shutil.copytree(tiny_model_dir / "asset" / "tokenizer", folder / "asset" / "tokenizer")
    (folder / "asset" / "gpt").mkdir()
    shutil.copy(tiny_model_dir / "asset" / "gpt" / "config.json", folder / "asset" / "gpt" / "config.json")
    shutil.copy(tiny_model_dir / "DEV_MODEL.json", folder / "DEV_MODEL.json")
    assert not list(folder.rglob("*.safetensors"))
    return load_text_side(folder, EngineOptions())


@pytest.mark.parametrize("text", SHORT_TEXTS + LONG_TEXTS)
def test_text_tokens_are_the_engines(tiny_engine: Any, light: TextSide, text: str) -> None:
    assert light.text_tokens(text) == tiny_engine.text_tokens(text)


def test_the_long_texts_take_the_exact_count(light: TextSide) -> None:
    # Past the budget the tokenizer counts (after the normalizer): that path is compared above too.
    budget = max(light.limits.segment_chars, light.limits.refine_tokens)
    assert all(len(speakable(text)) > budget for text in LONG_TEXTS)


def test_voices_are_the_engines(tiny_engine: Any, light: TextSide) -> None:
    from ChatTTS.model import Speaker

    dim = tiny_engine.hidden_size
    good = tiny_engine.voices.speaker_string("seed:5")
    assert good is not None
    voices = [
        "default",
        "seed:0",
        "seed:-7",
        "seed:123456789012345678901234567890",
        good,
        tiny_engine.voices.speaker_string("seed:99"),
        "",
        "seed:",
        "seed:x",
        "Seed:1",
        "alloy",
        good[:-3],  # truncated: not lzma any more
        good + "x",  # base16384 ignores a trailing odd character: still the same voice
        "字" * (2 * dim + 65),  # longer than any speaker string: not decoded at all
        Speaker._encode(torch.zeros(dim + 1)),  # another model's size
        Speaker._encode(torch.full((dim,), float("nan"))),  # not finite
    ]
    answers = [(voice[:20], light.validate_voice(voice)) for voice in voices]
    assert answers == [(voice[:20], tiny_engine.validate_voice(voice)) for voice in voices]
    assert [ok for _, ok in answers].count(False) == 9  # the bad ones are refused: not all alike


def test_the_engine_answers_through_the_same_text_side_class(tiny_engine: Any) -> None:
    assert type(tiny_engine.text_side) is TextSide
