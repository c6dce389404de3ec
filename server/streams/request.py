"""What a client asks for when it opens a stream, in no wire format."""

from __future__ import annotations

from dataclasses import dataclass

from server.engine_api import SynthesisParams


@dataclass(frozen=True, kw_only=True)
class SpeechRequest:
    """One stream a client asks for, in no wire format (see ``docs/protocol.md`` for the fields).

    Attributes:
        name: the client's id for the stream, echoed in its replies.
        text: the text; may be None (or partial) when ``incremental``.
        incremental: more text comes with ``append`` until ``end``.
        refine: run the model's refinement pass on each segment first.
        refine_prompt: its sentence-level controls (``[oral_2][laugh_0][break_6]``).
        word_timestamps: time each segment's words (``Words`` items in the outbox).
        frame_ms: each wire frame's length (20, 40, 60; formats with fixed frames only).
    """

    name: str
    text: str | None
    voice: str = "default"
    speed: float = 1.0
    format: str = "pcm16"
    sample_rate: int = 24_000
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    incremental: bool = False
    max_buffer_delay_ms: float | None = None
    refine: bool = False
    refine_prompt: str = ""
    word_timestamps: bool = False
    frame_ms: int = 20

    @property
    def params(self) -> SynthesisParams:
        """Synthesis parameters; unset sampling controls keep the model's defaults."""
        defaults = SynthesisParams()
        return SynthesisParams(
            voice=self.voice,
            speed=self.speed,
            seed=self.seed,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            refine=self.refine,
            refine_prompt=self.refine_prompt,
        )
