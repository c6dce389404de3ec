"""Voices (speaker embeddings) and prompt controls for the ChatTTS engine.

A voice is ``"default"``, ``"seed:<int>"`` or a ChatTTS speaker string (the
base16384 text of lzma-compressed float16 values that
``Chat.sample_random_speaker()`` returns). ``seed:N`` draws exactly what
``torch.manual_seed(N); chat.speaker._sample_random()`` draws on the CPU,
but from a private generator, so it neither reads nor disturbs global RNG
state and is the same on every machine.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

#: ``[speed_k]`` control used at speed 1.0 (ChatTTS's default prompt).
DEFAULT_SPEED_TOKEN = 5


def speed_token(speed: float) -> str:
    """Map a speed factor (0.5–2.0) to ChatTTS's nearest ``[speed_k]`` prompt token.

    ChatTTS has ten speed controls, ``[speed_5]`` being normal; one octave of
    speed (×2 or ×½) is mapped to five steps, clamped to 0..9.
    """
    if not math.isfinite(speed) or speed <= 0:
        speed = 1.0
    k = round(DEFAULT_SPEED_TOKEN + 5.0 * math.log2(speed))
    return f"[speed_{min(9, max(0, k))}]"


def parse_seed(voice: str) -> int | None:
    """The integer of a ``seed:<int>`` voice, else ``None``."""
    prefix, sep, number = voice.partition(":")
    if prefix != "seed" or not sep:
        return None
    try:
        return int(number)
    except ValueError:
        return None


class VoiceBank:
    """Resolves voice names to speaker embeddings (float16 CPU tensors), with a small cache.

    Args:
        speaker: ChatTTS's loaded ``Speaker`` (holds ``spk_stat`` std/mean).
        dim: GPT hidden size (the speaker embedding length).
        default_voice: what ``"default"`` means (a ``seed:N`` or speaker string).
        cache_size: resolved voices kept.
    """

    def __init__(self, speaker: object, dim: int, *, default_voice: str, cache_size: int = 256) -> None:
        self._speaker = speaker
        self.dim = dim
        self.default_voice = default_voice
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_size = cache_size
        if default_voice == "default" or self.resolve(default_voice) is None:
            raise ValueError(f"default_voice {default_voice!r} is not a seed:N voice or speaker string")

    def seeded(self, seed: int) -> torch.Tensor:
        """The speaker ``sample_random_speaker()`` gives after ``torch.manual_seed(seed)`` (CPU)."""
        std: torch.Tensor = self._speaker.std  # type: ignore[attr-defined]
        mean: torch.Tensor = self._speaker.mean  # type: ignore[attr-defined]
        gen = torch.Generator(device="cpu").manual_seed(seed % (1 << 64))
        spk = torch.randn(self.dim, generator=gen, dtype=std.dtype)
        return spk.mul_(std.cpu()).add_(mean.cpu())

    @property
    def max_string_chars(self) -> int:
        """The longest speaker string decoded: ``dim`` float16 values, lzma-compressed, base16384.

        A real one is about 1.1 characters per value, 840 for ChatTTS's 768 (incompressible
        float16 plus LZMA2's small overhead, 14 bits per character); anything far longer is not
        a speaker string, and decoding it could inflate a small message into a large buffer (an
        lzma bomb).
        """
        return 2 * self.dim + 64

    def _decode_string(self, voice: str) -> torch.Tensor | None:
        if len(voice) > self.max_string_chars:
            return None
        try:
            values = self._speaker._decode(voice)  # type: ignore[attr-defined]
        except Exception:  # not base16384/lzma: not a speaker string
            return None
        if values.shape != (self.dim,) or not bool(torch.isfinite(torch.from_numpy(values)).all()):
            return None
        return torch.from_numpy(values)

    def is_voice(self, voice: str) -> bool:
        """Whether ``voice`` names a voice, without touching the cache.

        Called from the event loop (admission) while the engine thread resolves voices: only the
        engine thread may change the cache, since ``OrderedDict`` updates from two threads race
        (a lookup's ``move_to_end`` after the other thread evicted the key raises ``KeyError``).
        Cheap: a seed is parsed, a speaker string (bounded by :attr:`max_string_chars`) decoded.
        """
        if voice == "default" or parse_seed(voice) is not None:
            return True
        return self._decode_string(voice) is not None

    def resolve(self, voice: str) -> torch.Tensor | None:
        """The speaker embedding ``voice`` names, or ``None``.

        Voices from recordings are not named here: a stream carries its own
        (``SynthesisParams.reference``).
        """
        if voice == "default":
            voice = self.default_voice
        hit = self._cache.get(voice)
        if hit is not None:
            self._cache.move_to_end(voice)
            return hit
        seed = parse_seed(voice)
        spk = self.seeded(seed) if seed is not None else self._decode_string(voice)
        if spk is None:
            return None
        self._cache[voice] = spk
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return spk

    def speaker_string(self, voice: str) -> str | None:
        """The ChatTTS speaker string of ``voice`` (what ``sample_random_speaker()`` returns)."""
        spk = self.resolve(voice)
        if spk is None:
            return None
        text: str = self._speaker._encode(spk)  # type: ignore[attr-defined]
        return text
