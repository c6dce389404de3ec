"""A reference recording for a voice: decoding an upload and checking it can make a voice.

Runs off the event loop (the caller uses a worker thread): libsndfile (``soundfile``) decodes
the upload, and soxr resamples it to the 24 kHz mono that ChatTTS's DVAE encodes. Every
refusal is a :class:`ReferenceAudioError` whose message says what is wrong and is safe to
show the client (the HTTP API answers it with 400). No torch here: the engine makes the
codes later, on the inference thread.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import numpy.typing as npt
import soundfile
import soxr

#: ChatTTS's DVAE works on 24 kHz audio.
REFERENCE_RATE = 24_000
#: The longest recording any setting accepts (``--voice-max-seconds`` may lower it).
MAX_REFERENCE_S = 30.0
#: Shortest accepted recording: under this there is too little voice to copy.
MIN_REFERENCE_S = 1.0
#: Peak amplitude under which a recording counts as silent (−60 dBFS).
SILENCE_PEAK = 1e-3
#: Transcript characters allowed per second of the longest recording: fast English is about
#: 15 characters a second, Chinese about 5; the transcript is part of every prompt in that voice.
TRANSCRIPT_CHARS_PER_SECOND = 20
_RATES = (8_000, 192_000)


class ReferenceAudioError(ValueError):
    """The recording cannot make a voice; the message says why (safe to show a client)."""


def transcript_limit(max_seconds: float) -> int:
    """The longest transcript (characters) for recordings of up to ``max_seconds``."""
    return math.ceil(TRANSCRIPT_CHARS_PER_SECOND * max_seconds)


def decode_recording(data: bytes, *, max_seconds: float) -> npt.NDArray[np.float32]:
    """Mono float32 at 24 kHz from an uploaded file, or :class:`ReferenceAudioError` saying why not.

    Any format libsndfile reads is taken (WAV, Ogg Vorbis/Opus, FLAC, MP3, AIFF…). The length
    is checked from the header before the samples are decoded.
    """
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            rate, frames = int(sound.samplerate), int(sound.frames)
            _check_rate_and_length(rate, frames, max_seconds)
            samples = sound.read(dtype="float32", always_2d=True)
    except soundfile.LibsndfileError as exc:
        reason = str(exc).split(": ", 1)[-1] or "unreadable"
        raise ReferenceAudioError(
            f"the upload is not a recording that can be read (WAV, Ogg, FLAC or MP3): {reason}"
        ) from None
    except (RuntimeError, TypeError, ValueError) as exc:
        if isinstance(exc, ReferenceAudioError):
            raise
        raise ReferenceAudioError(f"the upload is not a readable recording: {exc}") from None
    return check_reference_audio(samples, rate, max_seconds=max_seconds)


def _check_rate_and_length(rate: int, frames: int, max_seconds: float) -> None:
    if not _RATES[0] <= rate <= _RATES[1]:
        raise ReferenceAudioError(f"sample rate {rate} Hz is not supported ({_RATES[0]} to {_RATES[1]} Hz)")
    seconds = frames / rate
    if seconds > max_seconds:
        raise ReferenceAudioError(
            f"the recording is {seconds:.1f} s long; at most {max_seconds:g} s (--voice-max-seconds)"
        )
    if seconds < MIN_REFERENCE_S:
        raise ReferenceAudioError(f"the recording is {seconds:.2f} s long; at least {MIN_REFERENCE_S:g} s")


def check_reference_audio(
    samples: npt.NDArray[Any], sample_rate: int, *, max_seconds: float = MAX_REFERENCE_S
) -> npt.NDArray[np.float32]:
    """Mono float32 at 24 kHz from decoded samples, or :class:`ReferenceAudioError` saying why not.

    Args:
        samples: ``(n,)`` mono or ``(n, channels)`` samples, float in [-1, 1] or int16.
        sample_rate: their rate in Hz (8 kHz to 192 kHz).
        max_seconds: the longest recording accepted.
    """
    audio = np.asarray(samples)
    if audio.dtype == np.int16:
        audio = audio.astype(np.float32) / 32768.0
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
        raise ReferenceAudioError("expected mono or multi-channel PCM samples")
    _check_rate_and_length(sample_rate, len(audio), max_seconds)
    if not np.isfinite(audio).all():
        raise ReferenceAudioError("the recording has NaN or infinite samples")
    if float(np.abs(audio).max()) < SILENCE_PEAK:
        raise ReferenceAudioError("the recording is silent (peak below -60 dBFS)")
    audio = audio.astype(np.float32)
    if sample_rate != REFERENCE_RATE:
        audio = soxr.resample(audio, sample_rate, REFERENCE_RATE).astype(np.float32)
    clipped: npt.NDArray[np.float32] = np.clip(audio, -1.0, 1.0)
    return clipped
