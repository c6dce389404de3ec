"""Each sequence's code prompt, the longest prompt a KV slot must hold, and voices from recordings.

A prompt is ChatTTS's ``[Stts][spk_emb][speed_k]{text}[Ptts]`` for a speaker embedding, or
``[Stts][empty_spk]{transcript}[speed_k]{text}[Ptts]`` followed by the recording's codes for a
voice from a recording (:mod:`server.engine.chattts.reference`). ``text`` is the segment after
the text pipeline, or its refinement (``refine: true``), which ChatTTS does not normalize again.

:class:`PromptLimits` bounds every part of a prompt (segment text, refined text, transcript,
recording codes), and :meth:`PromptBuilder.longest` turns those bounds into the longest prompt
the server can meet: the KV slots are sized for it and warm-up prefills every bucket up to
it, so a prompt in a recording's voice never meets an unwarmed shape or an undersized slot.

Only ``server/engine/chattts*.py`` import torch; this is one of them.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.engine.chattts.reference import (
    CodePrompt,
    ReferenceVoice,
    code_prompt,
    encode_reference,
    reference_codes,
)
from server.engine.chattts.text import ChatTTSText
from server.engine.chattts.voice import VoiceBank, speed_token
from server.engine_api import AudioArray, Codes, EngineError, SynthesisParams, VoiceSample

#: ChatTTS's DVAE encodes 24 kHz audio.
_RATE = 24_000


@dataclass(frozen=True, kw_only=True)
class PromptLimits:
    """What the longest prompt may hold.

    Attributes:
        segment_chars: the longest segment (``--segment-max-chars``), as that many tokens: the stream
            layer holds every segment to it (or ``refine_tokens``) by
            :meth:`~server.engine.chattts.textside.TextSide.text_tokens`.
        refine_tokens: the longest refinement (``--refine-max-tokens``; 0: refinement off).
        voice_seconds: the longest recording of a voice (``--voice-max-seconds``; 0: off).
        transcript_tokens: the longest transcript of a recording, in model tokens.
    """

    segment_chars: int = 120
    refine_tokens: int = 384
    voice_seconds: float = 10.0
    transcript_tokens: int = 200

    @property
    def voice_codes(self) -> int:
        """Codes of the longest recording (0 when voices from recordings are off)."""
        return reference_codes(math.ceil(self.voice_seconds * _RATE)) if self.voice_seconds > 0 else 0


class PromptBuilder:
    """Code prompts for the engine's sequences (ChatTTS's ``_infer_code`` inputs).

    Args:
        chat: the loaded ``ChatTTS.Chat``.
        text: the text pipeline.
        voices: speaker embeddings by name.
        limits: the bounds of every part of a prompt.
        device: where the ids go.
    """

    def __init__(
        self, chat: Any, text: ChatTTSText, voices: VoiceBank, limits: PromptLimits, device: torch.device
    ) -> None:
        self._chat, self.text, self.voices, self.limits, self.device = chat, text, voices, limits, device
        self._transcripts: OrderedDict[str, str] = OrderedDict()

    def code_prompt(self, model_text: str, params: SynthesisParams) -> CodePrompt:
        """The prompt for ``model_text`` (already through the pipeline, or refined) in ``params``' voice.

        Raises:
            EngineError: the voice is unknown.
        """
        speed = speed_token(params.speed)
        voice: torch.Tensor | ReferenceVoice | None
        if params.reference is not None:
            voice = self._recording(params.reference)
        else:
            voice = self.voices.resolve(params.voice)
        if voice is None:
            raise EngineError(f"unknown voice {params.voice!r}")
        return code_prompt(self._chat, model_text, speed, voice, device=self.device)

    def _recording(self, sample: VoiceSample) -> ReferenceVoice:
        """The recording voice of ``sample``; its transcript goes through the text pipeline once."""
        model = self._transcripts.get(sample.transcript)
        if model is None:
            model = self._transcripts[sample.transcript] = self.text.model_text(sample.transcript)
            if len(self._transcripts) > 256:
                self._transcripts.popitem(last=False)
        return ReferenceVoice(codes=torch.from_numpy(sample.codes.astype(np.int64)), transcript=model)

    def tokens(self, model_text: str) -> int:
        """Tokens of ``model_text`` alone (no prompt around it)."""
        ids = self._chat.tokenizer._tokenizer(model_text, add_special_tokens=False)["input_ids"]
        return len(ids)

    def prompt_tokens(self, model_text: str) -> int:
        """Prompt length of ``model_text`` in the default voice."""
        return int(self.code_prompt(model_text, SynthesisParams()).input_ids.shape[1])

    def longest(self) -> int:
        """The longest prompt :attr:`limits` allow: text (segment or refinement), transcript, codes."""
        lim = self.limits
        text = max(lim.segment_chars, lim.refine_tokens)
        voice = lim.transcript_tokens + lim.voice_codes if lim.voice_seconds > 0 else 0
        return self.prompt_tokens("字" * text) + voice  # [empty_spk] is one token, as [spk_emb]

    def encode_voice(self, audio: AudioArray, transcript: str) -> Codes:
        """Codes of a 24 kHz recording for a :class:`VoiceSample`, within :attr:`limits`.

        Raises:
            ValueError: voices are off, the recording is too long, or the transcript is empty
                or too long for the model; the message is safe to show a client.
        """
        lim = self.limits
        if lim.voice_seconds <= 0:
            raise ValueError("voices from recordings are off on this server (--voice-max-seconds 0)")
        if reference_codes(len(audio)) > lim.voice_codes:
            seconds = len(audio) / _RATE
            raise ValueError(f"the recording is {seconds:.1f} s long; at most {lim.voice_seconds:g} s")
        model = self.text.model_text(transcript)
        if not model.strip():
            raise ValueError("the transcript has nothing to speak")
        tokens = self.tokens(model)
        if tokens > lim.transcript_tokens:
            limit = lim.transcript_tokens
            raise ValueError(f"the transcript is {tokens} tokens for the model; at most {limit}")
        codes = encode_reference(self._chat, audio)
        return codes.numpy().astype(np.uint16)


def file_identity(path: Path) -> str:
    """``sha256:<hex>`` of a file (the weights that make a voice's codes)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"
