r"""The text ChatTTS's GPT receives for one segment: our number speller, then ChatTTS's normalizer.

ChatTTS's ``infer`` passes every text through ``Chat.normalizer`` (``ChatTTS/norm.py``): it
keeps only the characters the model was trained on (CJK ideographs, Latin letters,
``，。、,.`` and space), maps other punctuation to those (``! : ; ( ) -`` → ``, .``; Chinese
text gets full-width punctuation first), replaces Chinese characters the model misreads by
homophones it reads right (the ``homophones_map.json`` that ships inside the ChatTTS
package, so it works offline for the official weights and dev models alike), and leaves
``[\w+]`` control tags alone. It deletes digits, so our speller
(:func:`server.text.normalize.speakable`, which also keeps tags) runs first:

    model text = Chat.normalizer(speakable(segment))

with ``infer``'s defaults (text normalization and homophone replacement on, language
detected per segment). Captions keep the user's original text; only the model sees this.
``tests/model/test_text_pipeline.py`` holds it equal to ChatTTS's own normalizer.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from numba.core.errors import NumbaPendingDeprecationWarning

from server.text.normalize import speakable

log = logging.getLogger(__name__)
# ChatTTS's normalizer passes Python lists to numba (``_combine_tags``); numba warns about that
# once, when it compiles. It is ChatTTS's code and works; the warning is only noise in our log.
warnings.filterwarnings("ignore", message=r"(?s).*reflected list", category=NumbaPendingDeprecationWarning)
#: Reaches every numba-compiled path of the normalizer (tags, replaced characters, homophones).
_WARM_TEXT = "预热 warm up [uv_break] 後来，好吗？!"


class _QuietLog:
    """ChatTTS's normalizer logs every replaced character at warning/info; that is per-request noise."""

    def debug(self, msg: object, *args: object) -> None:
        log.debug(msg, *args)

    info = warning = debug


class ChatTTSText:
    """Turns a segment into the text the model is given.

    Args:
        normalizer: the ``ChatTTS.norm.Normalizer`` a ``ChatTTS.Chat`` built (``chat.normalizer``).
    """

    def __init__(self, normalizer: Any) -> None:
        normalizer.logger = _QuietLog()
        self._normalizer = normalizer
        self.model_text(_WARM_TEXT)  # numba compiles here (~1 s), not in the first request

    def model_text(self, segment: str) -> str:
        """``Chat.normalizer(speakable(segment))`` with ChatTTS ``infer``'s default switches."""
        text: str = self._normalizer(
            speakable(segment), do_text_normalization=True, do_homophone_replacement=True, lang=None
        )
        return text
