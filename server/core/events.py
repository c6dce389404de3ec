"""What crosses between the event loop and the inference thread: typed commands and events.

Every command and event is a plain, frozen value (numbers, strings, tuples,
numpy arrays, the engine's value types), so the engine core could move into
its own process without either side changing: only the transport would.
Commands go from the :class:`~server.core.client.EngineClient` to the
:class:`~server.core.engine_core.EngineCore`; events come back in batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from server.engine_api import AudioArray, Codes, EngineInfo, SynthesisParams

#: Why a stream ended: all of it was generated, it was cancelled, or the engine failed.
EndReason = Literal["complete", "cancelled", "error"]

# --- commands (event loop → core) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Add:
    """A new stream: its first segments; ``input_closed`` is False while more may be appended.

    ``first_segment``: the stream's index of ``segments[0]`` (its seed offset).
    """

    stream_id: int
    segments: tuple[str, ...]
    params: SynthesisParams
    input_closed: bool = True
    client: str = ""  # who asked: the queue takes turns by client
    first_segment: int = 0  # the stream's index of segments[0] (its seed offset)


@dataclass(frozen=True, slots=True)
class Append:
    """One more segment for an open stream (incremental text)."""

    stream_id: int
    text: str


@dataclass(frozen=True, slots=True)
class EndInput:
    """No more segments will be appended: the stream ends after the ones it has."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop generating the stream; its engine rows are freed at the next block boundary."""

    stream_id: int


@dataclass(frozen=True, slots=True, eq=False)
class EncodeVoice:
    """Make a voice's codes from a recording (mono float32 at the engine's rate) and its transcript.

    Answered by :class:`VoiceEncoded`. The core runs at most one per round, between steps.
    """

    request_id: int
    audio: AudioArray
    transcript: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the loop after the commands before this one (every stream left ends with an error)."""


Command = Add | Append | EndInput | Cancel | EncodeVoice | Shutdown

# --- per-stream events (core → event loop) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentStarted:
    """Segment ``index`` (its text ``text``) starts with the stream's next audio."""

    stream_id: int
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class Audio:
    """New samples of the stream at the engine's native rate, in order.

    ``segment_end``: these are the last samples of their segment (may be empty), so what
    needs the segment's whole audio (its word timestamps) can be made before they go out.
    """

    stream_id: int
    samples: AudioArray
    segment_end: bool = False


@dataclass(frozen=True, slots=True)
class Ended:
    """The stream's last event; ``message`` says what failed when ``reason`` is ``error``."""

    stream_id: int
    reason: EndReason
    message: str = ""


StreamEvent = SegmentStarted | Audio | Ended

# --- core events ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Loaded:
    """The engine is loaded (warm-up follows); ``info`` is what the server advertises."""

    info: EngineInfo


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """The engine could not be loaded; ``message`` is one line naming the cause."""

    message: str


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine's warm-up is over: the loop serves."""


@dataclass(frozen=True, slots=True)
class BreakerChanged:
    """The breaker opened (steps keep failing) or closed (a probe or step succeeded)."""

    open: bool


@dataclass(frozen=True, slots=True)
class Admission:
    """What admission decides on (the rule is ``server.core.policy.refusal``).

    Attributes:
        waiting: sequences waiting for a batch slot.
        batch_limit: sequences one step may hold now (lowered after out-of-memory).
        seconds_per_block: moving average of one engine step.
        breaker_open: new streams are refused until a probe succeeds.
        by_client: how many sequences a listener waits for (a stream's current segment, not
            look-ahead) each client has waiting (clients with none are absent).
    """

    waiting: int
    batch_limit: int
    seconds_per_block: float
    breaker_open: bool
    by_client: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Capacity:
    """The policy's admission state after an iteration, and how many ``Add`` it has taken in.

    The client's own count of ``Add`` sent, minus ``adds_taken``, is what it sent
    that ``admission`` does not count yet.
    """

    admission: Admission
    adds_taken: int


@dataclass(frozen=True, slots=True, eq=False)
class VoiceEncoded:
    """The answer to :class:`EncodeVoice`: the codes, or why the recording cannot make a voice.

    Attributes:
        request_id: the command's.
        codes: ``(num_vq, T)`` codes; ``None`` when refused.
        message: why it was refused (safe to show a client); empty on success.
        failed: the engine itself failed (not the recording's fault).
    """

    request_id: int
    codes: Codes | None
    message: str = ""
    failed: bool = False


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The idle loop is alive (sent about once a second when nothing else is)."""


@dataclass(frozen=True, slots=True)
class Stopped:
    """The loop has ended and the engine is closed."""


CoreEvent = (
    StreamEvent | Loaded | LoadFailed | Ready | BreakerChanged | Capacity | VoiceEncoded | Heartbeat | Stopped
)
