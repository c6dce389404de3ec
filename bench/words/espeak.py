"""espeak-ng speech with its own word and phoneme positions: a reference with known word boundaries.

Speaks through libespeak-ng's C API (``ctypes``; Debian's ``espeak-ng`` package, no weights) in
synchronous mode with word and phoneme events. Every event carries the exact output sample it
belongs to, so the boundaries are espeak-ng's own, not estimated:

- a word starts at its first phoneme (after any pause phoneme or language switch that the word
  event comes before);
- it ends where the next word's first phoneme starts, or earlier where a pause phoneme (``_``,
  ``_:``, ``_!``…) of non-zero length begins (the pause at a comma or a full stop is no word's).

espeak-ng sometimes speaks two words as one entry of its dictionary ("of the"): one word event
then covers both, and the boundary between them is unknown. Such events are kept as one span
covering both words, and only its outer boundaries are scored.

Mandarin uses the ``cmn-latn-pinyin`` voice: espeak-ng 1.51's ``cmn`` voice reads every Chinese
character's pinyin as English ("你" as "nee three"); ``cmn-latn-pinyin`` reads the characters
right (pinyin only changes how Latin text is read) and emits one word event per character.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_LIST_TERMINATED, _WORD, _PHONEME = 0, 1, 7
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_PHONEME_EVENTS = 0x0001
_CHARS_UTF8 = 1
_PARAM_RATE = 1


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    """``espeak_EVENT`` (speak_lib.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", _EventId),
    ]


_Callback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event)
)


@dataclass(frozen=True)
class RefWord:
    """One word event: characters ``[first, last)`` of the text, spoken in samples ``[start, end)``."""

    first: int
    last: int
    start: int
    end: int


@dataclass(frozen=True)
class Utterance:
    """What espeak-ng said: float samples in [-1, 1], their rate, and its words in order."""

    samples: npt.NDArray[np.float32]
    sample_rate: int
    words: list[RefWord]


class Espeak:
    """libespeak-ng, loaded once (its state is global: one instance per process).

    Raises:
        OSError: libespeak-ng is not installed (``apt-get install espeak-ng``).
    """

    def __init__(self) -> None:
        path = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1"
        self._lib = ctypes.CDLL(path)
        self.sample_rate = int(
            self._lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, None, _INITIALIZE_PHONEME_EVENTS)
        )
        if self.sample_rate <= 0:
            raise OSError("espeak_Initialize failed (is espeak-ng-data installed?)")
        self._chunks: list[npt.NDArray[np.int16]] = []
        self._events: list[tuple[int, int, int, int, bytes]] = []
        self._callback = _Callback(self._on_audio)  # kept alive: the library holds the pointer
        self._lib.espeak_SetSynthCallback(self._callback)
        self._lib.espeak_Info.restype = ctypes.c_char_p
        self.version = self._lib.espeak_Info(None).decode()

    def _on_audio(self, wav: object, count: int, events: object) -> int:
        if count > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())  # type: ignore[arg-type]
        i = 0
        while events[i].type != _LIST_TERMINATED:  # type: ignore[index]
            e = events[i]  # type: ignore[index]
            name = bytes(e.id.string).rstrip(b"\0") if e.type == _PHONEME else b""
            self._events.append((e.type, e.text_position, e.length, e.sample, name))
            i += 1
        return 0

    def speak(self, text: str, voice: str, words_per_minute: int = 175) -> Utterance:
        """Synthesize ``text`` with ``voice``; the word positions come with it.

        Raises:
            ValueError: the voice is unknown.
        """
        if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        self._lib.espeak_SetParameter(_PARAM_RATE, words_per_minute, 0)
        self._chunks, self._events = [], []
        data = text.encode()
        self._lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, _CHARS_UTF8, None, None)
        self._lib.espeak_Synchronize()
        pcm = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        samples = (pcm.astype(np.float32) / 32768.0).astype(np.float32)
        return Utterance(samples, self.sample_rate, _words(self._events, len(samples)))


def _words(events: list[tuple[int, int, int, int, bytes]], total: int) -> list[RefWord]:
    """Word spans from the event list (see the module doc for the rules)."""
    spans: list[list[int | None]] = []  # per word event: first char, last char, first sound, pause start
    positions = [e[3] for e in events] + [total]
    for i, (kind, position, length, sample, name) in enumerate(events):
        if kind == _WORD:
            spans.append([position - 1, position - 1 + length, None, None])
        elif kind == _PHONEME and spans:
            word = spans[-1]
            if name.startswith(b"("):  # a language switch: no sound
                continue
            if name.startswith(b"_"):  # a pause; "_|" between syllables lasts no time
                if word[2] is not None and word[3] is None and positions[i + 1] > sample:
                    word[3] = sample
            elif word[2] is None:
                word[2] = sample
            else:
                word[3] = None  # sound again after a pause inside the word's events
    words: list[RefWord] = []
    heard = [w for w in spans if w[2] is not None]
    for k, (first, last, start, pause) in enumerate(heard):
        following = heard[k + 1][2] if k + 1 < len(heard) else total
        assert first is not None and last is not None and start is not None and following is not None
        words.append(RefWord(first, last, start, min(pause if pause is not None else following, following)))
    return words
