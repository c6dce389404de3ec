"""Python client for chattts-stream (protocol v1): streamed TTS over one WebSocket, auto-resume.

>>> async with Client("ws://127.0.0.1:8080/v1/stream") as client:
...     async for chunk in client.speak("Hello.", seed=42):
...         play(chunk.data)
"""

from chattts_stream_client.client import Client
from chattts_stream_client.errors import (
    BadRequest,
    ChatTTSStreamError,
    ConnectionLost,
    DuplicateId,
    EngineError,
    InternalError,
    Overloaded,
    ProtocolViolation,
    RateLimited,
    ResumeExpired,
    RetryableError,
    ShuttingDown,
    StreamTimeout,
    TextTooLong,
    TooManyStreams,
    Unauthorized,
    UnknownStream,
    Unsupported,
)
from chattts_stream_client.stream import SpeechStream
from chattts_stream_client.sync import SyncClient
from chattts_stream_client.wire import AudioChunk, Done, Segment, Word

__all__ = [
    "AudioChunk",
    "BadRequest",
    "ChatTTSStreamError",
    "Client",
    "ConnectionLost",
    "Done",
    "DuplicateId",
    "EngineError",
    "InternalError",
    "Overloaded",
    "ProtocolViolation",
    "RateLimited",
    "ResumeExpired",
    "RetryableError",
    "Segment",
    "ShuttingDown",
    "SpeechStream",
    "StreamTimeout",
    "SyncClient",
    "TextTooLong",
    "TooManyStreams",
    "Unauthorized",
    "UnknownStream",
    "Unsupported",
    "Word",
]
