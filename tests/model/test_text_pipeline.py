"""The text the model receives is ``Chat.normalizer(speakable(text))``, with control tags intact.

The expected side is built from a fresh ``ChatTTS.Chat()`` (its normalizer and homophone map
load from the installed package, offline) and ChatTTS's own prompt decoration; the engine side
is ``ChatTTSEngine.prompt_text``, the exact string the engine tokenizes.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from server.engine_api import SynthesisParams
from server.text.normalize import speakable
from server.text.tags import TAG

TEXTS = [
    # punctuation of both languages, quotes
    'Hello, world! Isn\'t it great? (Yes.) She said: "fine"; ok - done...',
    "你好！今天怎么样？我说：“很好”；（真的）【注意】《书名》——结束……",
    "‘Single’ and “double” quotes, «guillemets» and 'apostrophes'.",
    # numbers, dates, currency
    "It costs $12.50, or $1,200 for 3 people; 50% off until 2026.",
    "今天是2026年11月29日，温度-3.5度，占比50%，价格12元。",
    "Call 555-0199 at 10:30, v2.5 & mp3 files #1.",
    # tags
    "Hello [uv_break]world[laugh], 你好[lbreak]再见[break_3]。",
    "[speed_2][oral_2][laugh_0][break_6]Tags first, then text[v_break].",
    "数字[break_3]3个[laugh_2]，and 4 more[uv_break].",
    # emoji and other scripts
    "Great job 👍🎉! 太棒了😀。",
    "Café naïve résumé, Ελληνικά, こんにちは, 한국어.",
    # Chinese characters ChatTTS's homophone map replaces
    "噢，後来他说英镑的价格混淆了。",
]


@pytest.fixture(scope="module")
def chatttss_normalizer() -> Any:
    import ChatTTS

    return ChatTTS.Chat(logging.getLogger("native-chattts")).normalizer


def native_prompt(normalizer: Any, text: str, speed_prompt: str = "[speed_5]") -> str:
    from ChatTTS.model.speaker import Speaker

    decorated: list[str] = Speaker.decorate_code_prompts(
        [normalizer(speakable(text))], speed_prompt, None, "x"
    )
    return decorated[0]


@pytest.mark.parametrize("text", TEXTS)
def test_model_text_is_chattts_normalizer_of_speakable(
    tiny_engine: Any, chatttss_normalizer: Any, text: str
) -> None:
    prompt = tiny_engine.prompt_text(text, SynthesisParams())
    assert prompt == native_prompt(chatttss_normalizer, text)
    body = prompt.removeprefix("[Stts][spk_emb][speed_5]").removesuffix("[Ptts]")
    assert TAG.findall(body) == TAG.findall(text), "tags must reach the model unchanged and in order"
    assert not any(ch.isdigit() for ch in TAG.sub("", body)), "digits must be spelled out"


def test_the_pipeline_does_what_chattts_does_to_punctuation(tiny_engine: Any) -> None:
    """A readable contract for a few inputs (ChatTTS's choices, not ours)."""
    body = {
        text: tiny_engine.prompt_text(text, SynthesisParams())[
            len("[Stts][spk_emb][speed_5]") : -len("[Ptts]")
        ]
        for text in [
            "Wait! Really? Yes: 3.",
            "你好！真的吗？是的：3个。",
            "Hi [break_3] 4 [laugh]",
            "噢，後来英镑混淆了。",
            "Café naïve, Ægir.",
        ]
    }
    assert body == {
        "Wait! Really? Yes: 3.": "Wait. Really Yes, three.",
        "你好！真的吗？是的：3个。": "你好。真的吗是的，三个。",
        "Hi [break_3] 4 [laugh]": "Hi [break_3] four [laugh]",
        "噢，後来英镑混淆了。": "哦，后来英棒混肖了。",  # ChatTTS's homophone map
        "Café naïve, Ægir.": "Cafe naive, AEgir.",  # ours: accents folded, not dropped
    }


def test_a_tag_reaches_the_model_as_its_token(tiny_engine: Any, tiny_model_dir: Path) -> None:
    from ChatTTS.model import Tokenizer

    tokenizer = Tokenizer(str(tiny_model_dir / "asset" / "tokenizer"))
    prompt = tiny_engine.prompt_text("wait [break_3] now 3", SynthesisParams())
    ids = tokenizer.encode([prompt], 4)[0][0, :, 0].tolist()
    break_3 = tokenizer._tokenizer.convert_tokens_to_ids("[break_3]")
    assert ids.count(break_3) == 1
    assert "[break_3]" in prompt and "[break_three]" not in prompt


def test_every_allowed_tag_is_one_token_and_refinement_drops_the_numbered_ones(tiny_model_dir: Path) -> None:
    """The dev tokenizer has ChatTTS's 50 tokens in the official order, so [break_0] splits them
    as in the real vocabulary: infer() keeps refined tokens below it (word-level tags) only."""
    from ChatTTS.model import Tokenizer

    from server.text.tags import ALLOWED, RESERVED, WORD_TAGS

    tokenizer = Tokenizer(str(tiny_model_dir / "asset" / "tokenizer"))
    ids = {tag: tokenizer._tokenizer.convert_tokens_to_ids(tag) for tag in ALLOWED | RESERVED}
    assert tokenizer._tokenizer.unk_token_id not in ids.values()
    for tag, token_id in ids.items():
        assert tokenizer.encode([tag], 4)[0].shape[1] == 1, tag
        below = token_id < tokenizer.break_0_ids
        assert below == (tag in RESERVED or tag[1:-1] in WORD_TAGS), tag


#: Texts from many scripts: ``has_speakable`` must say yes exactly when ChatTTS's pipeline leaves
#: the model something to say.
SCRIPTS = [
    "Hello.", "你好。", "Café crème", "Ærøskøbing", "ŁÓDŹ", "١٢٣", "१२३", "42", "$5",
    "Привет мир.", "こんにちは。", "カタカナ", "안녕하세요", "Γειά σου", "مرحبا", "שלום", "สวัสดี",
    "😀🎉", "……！", "ⅷ", "²", "ＡＢＣ", "１２３", "㐀", "Привет, Bob.", "[uv_break]",
    "[laugh][laugh]", "[uv_break] Hi",
]  # fmt: skip


@pytest.mark.parametrize("text", SCRIPTS)
def test_has_speakable_matches_what_the_pipeline_leaves(tiny_engine: Any, text: str) -> None:
    from server.text.segments import has_speakable

    left = TAG.sub("", tiny_engine.text.model_text(text))
    model_can_say = re.search(r"[\u4e00-\u9fffA-Za-z]", left) is not None
    assert has_speakable(text) == model_can_say, (text, left)
