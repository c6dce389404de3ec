"""One voice list for every port: the names a client may speak with, what each is, and the refusal.

Every front end (the WebSocket, OpenAI's and ElevenLabs' HTTP APIs, Wyoming) hands the voice
name it received to the stream layer as it came; :class:`VoiceCatalog` is the one place that
resolves it (``SpeechService.open``) and the one place that lists the names (``hello``,
``GET /v1/audio/voices``, Wyoming's ``info``). So a name is the same voice on every port, an
unknown one is refused with the same list of valid names, and a front end added later gets
both by passing the name through.

The names: the engine's named voices (``default``; ChatTTS's ``seed:<int>`` is a pattern, not
listed), OpenAI's voice names (each a fixed ChatTTS seed, so ``nova`` is one reproducible
voice everywhere), and the voices made from recordings the client's tenant sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from server.core.client import EngineClient
from server.errors import UnknownVoice
from server.voices.library import StoredVoice, VoiceLibrary

#: OpenAI's voice names → reproducible ChatTTS voices (random speakers, not OpenAI's timbres).
_SEEDED: Final = "ash ballad coral echo fable nova onyx sage shimmer verse marin cedar".split()  # noqa: SIM905
OPENAI_VOICES: Final[Mapping[str, str]] = {"alloy": "default"} | {
    name: f"seed:{n}" for n, name in enumerate(_SEEDED, start=11)
}
#: An unknown voice's error names the voices from recordings only up to this many (a server
#: may hold hundreds); past it, the error counts them and says where they are all listed.
LISTED_RECORDINGS: Final = 8
#: The longest part of a refused name the error repeats (a ChatTTS speaker string is ~1.6 kB).
ECHOED_CHARS: Final = 64


@dataclass(frozen=True)
class VoiceEntry:
    """One name of the list: what a client sends, and the voice it speaks with.

    Attributes:
        name: the name a client passes as its voice.
        voice: the engine's voice it resolves to (``seed:14`` for ``echo``), or the recording's id.
        recording: the voice made from a recording, for those.
    """

    name: str
    voice: str
    recording: StoredVoice | None = None


def canonical(name: str) -> str:
    """The engine's name for ``name``: OpenAI's names mapped to their seeds, any other name as it is."""
    return OPENAI_VOICES.get(name, name)


class VoiceCatalog:
    """The voices of this server, as every front end lists and resolves them."""

    def __init__(self, engine: EngineClient, library: VoiceLibrary) -> None:
        self._engine = engine
        self._library = library

    def builtin(self) -> tuple[str, ...]:
        """The names every client has: the engine's named voices, then OpenAI's names."""
        return tuple(dict.fromkeys([*self._engine.info.voices, *OPENAI_VOICES]))

    def entries(self, owner: str | None = None) -> list[VoiceEntry]:
        """Every name ``owner`` may speak with, in the order all ports list them.

        The built-in names first, then the voices from recordings ``owner`` sees (oldest first).
        """
        entries = [VoiceEntry(name, canonical(name)) for name in self.builtin()]
        entries += [VoiceEntry(v.id, v.id, v) for v in self._library.all(owner)]
        return entries

    def names(self, owner: str | None = None) -> tuple[str, ...]:
        """The names of :meth:`entries` (``hello.voices``, Wyoming's ``info``)."""
        return tuple(entry.name for entry in self.entries(owner))

    def resolve(self, name: str, owner: str | None = None) -> tuple[str, StoredVoice | None]:
        """The voice ``name`` speaks with for ``owner``: the engine's name, and its recording if any.

        Engine voices that are patterns rather than names (ChatTTS's ``seed:<int>``, speaker
        strings) are the engine's to accept (``Engine.validate_voice``).

        Raises:
            UnknownVoice: ``owner`` has no such voice; the message names the valid ones.
        """
        voice = canonical(name)
        recording = self._library.get(voice, owner)
        if recording is None and not self._engine.validate_voice(voice):
            raise self.unknown(name, owner)
        return voice, recording

    def unknown(self, name: str, owner: str | None = None) -> UnknownVoice:
        """The refusal of ``name``: the built-in names, ``seed:<int>``, and the recordings (bounded)."""
        choices = ", ".join(self.builtin()) + ", seed:<int>"
        recordings = [v.id for v in self._library.all(owner)]
        if len(recordings) > LISTED_RECORDINGS:
            choices += (
                f", or one of {len(recordings)} voices from recordings "
                "(hello's voices and GET /v1/audio/voices list them all)"
            )
        elif recordings:
            choices += ", or a voice from a recording: " + ", ".join(recordings)
        echoed = name if len(name) <= ECHOED_CHARS else name[:ECHOED_CHARS] + "…"
        return UnknownVoice(echoed, choices)
