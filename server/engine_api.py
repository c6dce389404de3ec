"""The engine interface: token-block steps over a batch of sequences.

An engine owns a model. It holds the state of every sequence that was added
to it (KV-cache rows, random generator, decoder context) and advances the
sequences it is told to by one token block per :meth:`Engine.step`. The
engine core (``server.core.engine_core``) is the only caller and calls it from one
thread only, so engines need no locking.

A *sequence* is one text segment of one stream. Streams with several
segments are several sequences, submitted in order by the scheduler.

This module imports no torch: it is shared by the fake engine (tests, load
tests) and the ChatTTS engine.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

#: ChatTTS's native output sample rate; every engine produces audio at it.
NATIVE_SAMPLE_RATE = 24_000

AudioArray = npt.NDArray[np.float32]
#: ``(num_vq, T)`` audio codes of a recording (ChatTTS's DVAE codes are below 1024).
Codes = npt.NDArray[np.uint16]


class EngineError(Exception):
    """A failure inside an engine step; fails only the sequences of that step."""

    code = "engine_error"


class EngineOutOfMemory(EngineError):
    """The step ran out of accelerator memory; retrying with fewer rows may work."""


@dataclass(frozen=True, eq=False)
class VoiceSample:
    """A voice taken from a recording, as every engine takes it: the recording's codes and transcript.

    Travels inside :class:`SynthesisParams`, so a stream carries its own voice: deleting the
    voice later changes no stream already started, and the engine keeps no registry of them.
    Compared by identity (it holds an array); :attr:`digest` names its content.

    Attributes:
        codes: ``(num_vq, T)`` codes the engine's encoder made from the recording.
        transcript: what is said in the recording, as the user wrote it (the engine puts it
            through the same text pipeline as the spoken text).
    """

    codes: Codes
    transcript: str

    @cached_property
    def digest(self) -> str:
        """sha256 of the codes (with their shape) and the transcript: the voice's content identity."""
        h = hashlib.sha256(np.asarray(self.codes.shape, "<u4").tobytes())
        h.update(np.ascontiguousarray(self.codes, "<u2").tobytes())
        h.update(self.transcript.encode())
        return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class SynthesisParams:
    """Everything besides the text that changes the audio of a sequence.

    Attributes:
        voice: ``"default"``, ``"seed:<int>"``, a ChatTTS speaker string, or the name of
            ``reference`` when that is set.
        speed: 0.5 to 2.0; the engine maps it to its nearest native control.
        seed: seeds the sequence's own random generator; ``None`` = random.
        temperature: sampling temperature.
        top_p: nucleus sampling threshold.
        top_k: top-k sampling cut-off.
        refine: run the model's text refinement pass on each segment before its speech.
        refine_prompt: the refinement's sentence-level controls (``[oral_2][laugh_0][break_6]``).
        reference: speak in the voice of this recording (``voice`` is then only its name).
    """

    voice: str = "default"
    speed: float = 1.0
    seed: int | None = None
    temperature: float = 0.3
    top_p: float = 0.7
    top_k: int = 20
    refine: bool = False
    refine_prompt: str = ""
    reference: VoiceSample | None = None


@dataclass(frozen=True, kw_only=True)
class SequenceRequest:
    """One text segment to synthesize.

    Attributes:
        seq_id: unique among the sequences an engine holds; chosen by the caller.
        text: the segment's text (already normalized and split).
        params: voice and sampling parameters.
        max_tokens: hard cap on generated audio tokens for this sequence.
        seed_offset: added to ``params.seed`` so that segment k of a stream
            draws from its own reproducible generator.
    """

    seq_id: int
    text: str
    params: SynthesisParams
    max_tokens: int = 2048
    seed_offset: int = 0


# Audio tokens are ChatTTS's: 512 samples at 24 kHz, 46.9 a second of audio.
#: What any segment may last beyond its words: lead-in, breath and trailing silence (1 s).
SEGMENT_BASE_TOKENS = 47
#: A Latin letter at 4 letters a second: a third of an ordinary speaking rate (12-15 letters a
#: second), so even ``speed`` 0.5 with long pauses stays inside.
TOKENS_PER_LETTER = 12
#: A CJK character (one syllable) at 2 a second: half of a slow Mandarin rate (4-5 a second).
TOKENS_PER_CJK = 24
#: A digit is spelled out: up to about 8 letters a digit ("1234567" → 58 letters), 2 s.
TOKENS_PER_DIGIT = 94
#: A control tag (``[laugh]``, ``[uv_break]``) may add a laugh or a pause: 1 s.
TOKENS_PER_TAG = 47
_TAG = re.compile(r"\[\w+\]")  # the control tags of server.text.tags (checked before any engine)


def speech_tokens(text: str) -> int:
    """The audio tokens ``text``'s words may take at a generous (slow) speaking rate.

    Counts what the model speaks: Latin letters (accented ones too), CJK ideographs, digits
    (spelled out before the model sees them) and control tags; blanks, punctuation, emoji and
    other scripts (which ChatTTS's normalizer deletes) add nothing.
    """
    tags = len(_TAG.findall(text))
    tokens = tags * TOKENS_PER_TAG
    for ch in _TAG.sub(" ", text):
        if "\u3400" <= ch <= "\u9fff":
            tokens += TOKENS_PER_CJK
        elif ch.isdecimal():
            tokens += TOKENS_PER_DIGIT
        elif ch.isalpha() and (ch.isascii() or "\u00c0" <= ch <= "\u024f"):
            tokens += TOKENS_PER_LETTER
    return tokens


def segment_token_cap(text: str, ceiling: int) -> int:
    """The most audio tokens a segment of ``text`` may generate: its words' share, at most ``ceiling``.

    ``min(ceiling, 47 + speech_tokens(text))``: a short text cannot buy ``ceiling`` tokens of
    audio (2048 tokens are 44 s), and a model that babbles past the end of its text is cut off
    in proportion to the text, whatever the engine.
    """
    return max(1, min(ceiling, SEGMENT_BASE_TOKENS + speech_tokens(text)))


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one step produced for one sequence.

    Attributes:
        seq_id: the sequence.
        audio: new float32 samples at :data:`NATIVE_SAMPLE_RATE` (may be empty).
        tokens: audio tokens generated for this sequence in this step.
        finished: the sequence reached its end (EOS or token limit); all of its
            audio has been returned and the engine has already released it.
    """

    seq_id: int
    audio: AudioArray
    tokens: int
    finished: bool


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """Static facts the server advertises and the scheduler plans with."""

    name: str
    sample_rate: int = NATIVE_SAMPLE_RATE
    voices: tuple[str, ...] = ("default",)
    #: Audio samples one token decodes to (used to estimate throughput).
    samples_per_token: int = 512
    #: The engine runs a text refinement pass when ``SynthesisParams.refine`` asks for it.
    refine: bool = False
    #: Identity of what :meth:`Engine.encode_voice` makes codes with (voices made under another
    #: identity are not used); ``None``: the engine cannot make voices from recordings.
    voice_encoder: str | None = None
    #: The most tokens a segment's text may be for the model (:meth:`Engine.text_tokens`): its
    #: prompt then fits what the KV slots and the warm-up were sized for. ``None``: no limit.
    max_text_tokens: int | None = None
    #: The most sequences the engine holds at once (its KV slots): the scheduler's batch limit
    #: when ``--max-batch`` is 0. ``None``: no limit of its own.
    max_batch: int | None = None
    extra: dict[str, str] = field(default_factory=dict)


class EngineText(Protocol):
    """What the stream layer asks of the engine at once while it checks a request (any thread).

    :class:`Engine` answers both; where the engine runs in another process, the front end holds
    only an engine's text side that answers them (``server.core.factory.text_side``).
    """

    def validate_voice(self, voice: str) -> bool:
        """Whether ``voice`` names a voice this engine can speak."""
        ...

    def text_tokens(self, text: str) -> int:
        """Tokens ``text`` is for the model (:meth:`Engine.text_tokens`)."""
        ...


@runtime_checkable
class Engine(Protocol):
    """A model that advances many sequences in token blocks.

    Every method is called from the scheduler's single inference thread.
    """

    @property
    def info(self) -> EngineInfo:
        """Static facts about this engine."""
        ...

    def validate_voice(self, voice: str) -> bool:
        """Whether ``voice`` names a voice this engine can speak."""
        ...

    def text_tokens(self, text: str) -> int:
        """Tokens ``text`` is for the model after the engine's text pipeline (numbers spelled out).

        Called from the event loop while the inference thread steps: an engine answers it
        without touching state the inference thread uses. Exact above ``info.max_text_tokens``
        (the limit it is held to); at or below it an engine may answer a cheaper bound above the
        exact count that is itself within the limit (all a caller needs to know is that it fits).
        """
        ...

    def add(self, request: SequenceRequest) -> None:
        """Register a sequence; its prefill may run inside the next step."""
        ...

    def drop(self, seq_id: int) -> None:
        """Forget a sequence and free its state (no-op for unknown ids)."""
        ...

    def step(self, seq_ids: list[int]) -> list[StepResult]:
        """Advance the given sequences by one token block each.

        Returns one result per id, in any order. Raises :class:`EngineError`
        (or any exception) to fail the whole step; the caller then drops the
        step's sequences, or for :class:`EngineOutOfMemory` retries with fewer.
        """
        ...

    def encode_voice(self, audio: AudioArray, transcript: str) -> Codes:
        """Codes of a recording (mono float32 at :data:`NATIVE_SAMPLE_RATE`) for a :class:`VoiceSample`.

        Raises:
            ValueError: the recording or its transcript cannot make a voice; the message
                says why and is safe to show a client.
        """
        ...

    def warmup(self) -> None:
        """Run representative work once so that the first request is fast."""
        ...

    def close(self) -> None:
        """Release the model (called once, from the inference thread)."""
        ...
