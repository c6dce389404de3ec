"""The ChatTTS engine's text side: the two answers a front end needs while it checks a request.

``validate_voice`` (``default``, ``seed:<int>`` or a valid speaker string) and ``text_tokens``
(a segment's tokens for the model, numbers spelled out) need only ChatTTS's tokenizer, its
normalizer and the speaker statistics: none of the GPT, DVAE, Decoder or Vocos weights.

:class:`TextSide` answers both from those parts of a ``ChatTTS.Chat``. The engine builds its own
from the modules it loaded (:class:`~server.engine.chattts.engine.ChatTTSEngine`); a front end
whose engine runs in another process (``--engine-process``, ``--frontend-processes N``) builds
one with :func:`load_text_side` from the same model folder, loading only those parts. One class
and one set-up either way, so the two forms answer alike (``tests/model/test_text_side.py``).

Only ``server/engine/chattts/`` imports torch; this is one of those modules.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from server.engine.chattts.assets import new_chat, read_dev_manifest
from server.engine.chattts.options import EngineOptions
from server.engine.chattts.prompt import PromptLimits
from server.engine.chattts.text import ChatTTSText
from server.engine.chattts.voice import VoiceBank
from server.text.normalize import speakable

log = logging.getLogger(__name__)


def prompt_limits(options: EngineOptions) -> PromptLimits:
    """The bounds of every part of a prompt, from the engine's options (the KV slots are sized for them)."""
    return PromptLimits(
        segment_chars=options.warmup_prompt_chars,
        refine_tokens=max(0, options.refine_max_tokens),
        voice_seconds=float(options.voice_max_seconds),
        transcript_tokens=options.transcript_tokens,
    )


class TextSide:
    """The text pipeline, the voice names and the token counter over a ``ChatTTS.Chat``'s text parts.

    Args:
        chat: a ``ChatTTS.Chat`` with its ``normalizer``, ``tokenizer`` and ``speaker``.
        dim: the GPT's hidden size (a speaker embedding's length).
        options: the engine's options (the default voice, the prompt budget).
    """

    def __init__(self, chat: Any, *, dim: int, options: EngineOptions) -> None:
        self.text = ChatTTSText(chat.normalizer)
        self.voices = VoiceBank(chat.speaker, dim, default_voice=options.default_voice)
        self.limits = prompt_limits(options)
        # The event loop counts segments' tokens while the inference thread encodes prompts, and
        # ChatTTS's encode sets padding on its Rust tokenizer each call: the counter is a copy.
        self._counter = copy.deepcopy(chat.tokenizer._tokenizer)

    def validate_voice(self, voice: str) -> bool:
        """``default``, ``seed:<int>`` and valid ChatTTS speaker strings are voices (any thread)."""
        return self.voices.is_voice(voice)

    def text_tokens(self, segment: str) -> int:
        """Tokens of ``segment`` after the text pipeline, or a bound above them within the budget.

        Any thread: a tokenizer of its own and a pure pipeline. The exact count costs 1-5 ms of
        CPU (ChatTTS's normalizer); the number speller's output costs 0.1 ms and bounds it, as
        ChatTTS's normalizer only maps or deletes characters and a token covers at least one.
        So a text whose spelled-out length fits the budget (the text part of
        :meth:`~server.engine.chattts.prompt.PromptBuilder.longest`) answers that length, and
        only a longer one is counted exactly.
        """
        spoken = speakable(segment)
        if len(spoken) <= max(self.limits.segment_chars, self.limits.refine_tokens):
            return len(spoken)
        ids = self._counter(self.text.model_text(segment), add_special_tokens=False)["input_ids"]
        return len(ids)


def load_text_side(model_dir: Path, options: EngineOptions) -> TextSide:
    """The text side of the ChatTTS model in ``model_dir``: tokenizer, normalizer, speaker statistics.

    ``model_dir`` is the folder the engine process loaded (its ``EngineInfo.extra["model_dir"]``), so it
    is complete and its files were checked (against ChatTTS's hashes, or the dev manifest's)
    before the engine said it loaded; nothing is downloaded or checked here. The speaker
    statistics are the model's config's (a dev model's own, from its manifest), read as
    ``Chat._load`` reads them; the GPT's hidden size is its ``asset/gpt/config.json``'s, which is
    what the engine's Llama is built from.

    Raises:
        ModelUnavailableError: the folder's dev manifest does not read.
        OSError: a file is missing.
    """
    import torch
    from ChatTTS.model import Speaker, Tokenizer
    from transformers import LlamaConfig

    chat = new_chat(read_dev_manifest(model_dir))
    paths = chat.config.path
    chat.tokenizer = Tokenizer(str(model_dir / paths.tokenizer_path))
    chat.speaker = Speaker(chat.config.gpt.hidden_size, chat.config.spk_stat, torch.device("cpu"))
    dim = int(LlamaConfig.from_pretrained(str(model_dir / paths.gpt_ckpt_path)).hidden_size)
    log.info("the ChatTTS text side (tokenizer, normalizer, speaker statistics) loaded from %s", model_dir)
    return TextSide(chat, dim=dim, options=options)
