"""Voices from a reference recording, and the code prompt ChatTTS builds for any voice.

ChatTTS 0.2 can speak in the voice of a short recording: ``Chat.sample_audio_speaker(wav)``
encodes 24 kHz audio with the DVAE encoder into audio codes (``(num_vq, T)``, about 47 per
second) and packs them into a string (``spk_smp``); ``infer`` takes that string with the
recording's transcript (``txt_smp``). ``Chat._infer_code`` then builds the prompt as

    text:   [Stts][empty_spk]{txt_smp}{[speed_k]}{text}[Ptts]        ([spk_emb] when spk_emb is set)
    tokens: the text's tokens, then the recording's T code vectors   (tokenizer.encode(prompt=codes))

so the model continues the recording: generation starts right after its codes, conditioned on
its transcript, and no speaker embedding is written (``[empty_spk]``) unless one is given too.
:func:`code_prompt` builds exactly those inputs for both kinds of voice;
``tests/model/test_refine_voice.py`` holds them, and the generated tokens, equal to native.

``infer`` passes ``txt_smp`` to the model as given, unnormalized; a :class:`ReferenceVoice`
keeps the transcript as the model should read it, so callers put it through the same text
pipeline as the spoken text (``ChatTTSText.model_text``) when they create the voice.

Only ``server/engine/chattts*.py`` import torch; this is one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch


@dataclass(frozen=True)
class ReferenceVoice:
    """A voice taken from a recording.

    Attributes:
        codes: ``(num_vq, T)`` DVAE codes of the recording (what ``spk_smp`` packs), int64, CPU.
        transcript: what is said in it, as the model reads it (after the text pipeline).
    """

    codes: torch.Tensor
    transcript: str

    @property
    def spk_smp(self) -> str:
        """ChatTTS's string form of the codes (``Chat.sample_audio_speaker``'s result)."""
        from ChatTTS.model.speaker import Speaker

        text: str = Speaker.encode_prompt(self.codes)
        return text

    @classmethod
    def from_spk_smp(cls, spk_smp: str, transcript: str) -> ReferenceVoice:
        """The voice a ChatTTS ``spk_smp`` string and its transcript describe."""
        from ChatTTS.model.speaker import Speaker

        return cls(codes=Speaker.decode_prompt(spk_smp).to(torch.long), transcript=transcript)


def encode_reference(chat: Any, audio_24k: npt.NDArray[np.float32]) -> torch.Tensor:
    """``(num_vq, T)`` DVAE codes of 24 kHz audio: ``Chat.sample_audio_speaker`` before its packing.

    Decoded by :func:`server.voices.recording.decode_recording` and checked there (length, rate,
    silence) before it reaches the inference thread.
    """
    with torch.inference_mode():
        codes: torch.Tensor = chat.dvae.sample_audio(torch.from_numpy(np.ascontiguousarray(audio_24k)))
    return codes.to(device="cpu", dtype=torch.long)


def reference_codes(samples: int) -> int:
    """How many codes ``encode_reference`` makes of ``samples`` samples at 24 kHz (46.875 a second).

    The DVAE's mel spectrogram (``n_fft`` 1024, hop 256, centred) has ``1 + samples // 256``
    frames; its stride-2 convolution (kernel 4, padding 1) halves them.
    """
    frames = 1 + samples // 256
    return (frames - 2) // 2 + 1


@dataclass(frozen=True)
class CodePrompt:
    """The GPT's inputs for one sequence, as ``Chat._infer_code`` builds them.

    Attributes:
        text: the decorated prompt text the tokenizer reads.
        input_ids: ``(1, L, num_vq)``: text tokens (repeated over the streams), then any sample codes.
        text_mask: ``(1, L)`` bool: True at text tokens.
        speaker: the embedding written at ``[spk_emb]``; ``None`` for ``[empty_spk]``.
    """

    text: str
    input_ids: torch.Tensor
    text_mask: torch.Tensor
    speaker: torch.Tensor | None


def decorate(chat: Any, model_text: str, speed: str, voice: torch.Tensor | ReferenceVoice) -> str:
    """The prompt text ``_infer_code`` writes for ``voice`` (``Speaker.decorate_code_prompts``)."""
    if isinstance(voice, ReferenceVoice):
        decorated: list[str] = chat.speaker.decorate_code_prompts([model_text], speed, voice.transcript, None)
    else:
        decorated = chat.speaker.decorate_code_prompts([model_text], speed, None, "spk")
    return decorated[0]


def code_prompt(
    chat: Any, model_text: str, speed: str, voice: torch.Tensor | ReferenceVoice, *, device: torch.device
) -> CodePrompt:
    """Tokenize the prompt for ``voice`` (a speaker embedding, or a reference recording's codes).

    Args:
        chat: the loaded ``ChatTTS.Chat``.
        model_text: the segment after the text pipeline.
        speed: the ``[speed_k]`` control.
        voice: a speaker embedding, or a :class:`ReferenceVoice`.
        device: where the ids go.
    """
    text = decorate(chat, model_text, speed, voice)
    sample = voice.codes if isinstance(voice, ReferenceVoice) else None
    num_vq = int(chat.embed.num_vq)
    input_ids, _, text_mask = chat.tokenizer.encode([text], num_vq, prompt=sample, device=device)
    return CodePrompt(
        text=text,
        input_ids=input_ids,
        text_mask=text_mask,
        speaker=None if isinstance(voice, ReferenceVoice) else voice,
    )
