"""Fetching the official weights from the Hugging Face hub (or a mirror), checked by hash.

``huggingface_hub`` does the transfer, so what users of the hub expect holds: ``HF_ENDPOINT``
points it at a mirror, ``HF_TOKEN`` and proxies are honoured, progress bars show, and a file
cut off part-way is resumed from its ``.incomplete`` part with a ``Range`` request, both by the
retries here and by running the command again. Only the nine files ChatTTS loads are fetched.

The hub's ETag of a large file is its sha256, but nothing in the transfer compares the bytes to
it. Every file is therefore hashed after the transfer and held to ChatTTS's own map; a file that
differs is deleted (in the hub cache: its blob too, which the cache would otherwise reuse under
the right name), so no later run or server start can take it for a good one.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from server.engine.weights.files import Expected, Problem, check_file

REPO_ID = "2Noise/ChatTTS"
#: How long the first connect to the hub may take before the command says it is unreachable.
CONNECT_TIMEOUT_S = 5.0


class DownloadError(RuntimeError):
    """The weights could not be fetched or were refused; the one-line message says what to do."""


class HashMismatch(DownloadError):
    """Fetched files differ from the expected hashes (they were deleted); ``problems`` names them."""

    def __init__(self, message: str, problems: list[Problem]) -> None:
        super().__init__(message)
        self.problems = problems


def hub_endpoint() -> str:
    """The hub ``huggingface_hub`` talks to: ``HF_ENDPOINT`` or https://huggingface.co."""
    from huggingface_hub import constants

    endpoint: str = constants.ENDPOINT
    return endpoint


def unreachable_reason(timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """``None`` when the hub answers a TCP connect within ``timeout_s``, else the reason.

    huggingface_hub retries and waits on its own; a raw connect fails in well under a second
    offline, which is what a person at the command line needs.
    """
    url = urlparse(hub_endpoint())
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"cannot reach {host}:{port} ({exc.__class__.__name__}: {exc})"


def cached_snapshot(cache_dir: Path, files: list[str], revision: str = "main") -> Path | None:
    """The snapshot folder of ``revision`` in the hub cache ``cache_dir``, or ``None`` (no network).

    It may lack files; the caller checks them.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(
            repo_id=REPO_ID,
            revision=revision,
            allow_patterns=files,
            cache_dir=cache_dir,
            local_files_only=True,
        )
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return Path(found)


def _permanent(exc: Exception) -> bool:
    """Whether trying again cannot help: no such repository, revision or file, no access, offline."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if isinstance(exc, LocalEntryNotFoundError):  # the hub could not be asked: a network failure
        return bool(constants.HF_HUB_OFFLINE)
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        return status is not None and 400 <= status < 500 and status not in (408, 429)
    return isinstance(exc, (ValueError, PermissionError))


def _reason(exc: BaseException) -> str:
    """What went wrong, in words: huggingface_hub's own messages start with a bare status line."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):  # a RepositoryNotFoundError: first
        return "the repository is gated: accept its terms on the hub and set HF_TOKEN"
    if isinstance(exc, RepositoryNotFoundError):
        return f"no repository {REPO_ID} there (or it needs HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return "no such revision (a branch, tag or commit of the repository)"
    if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
        return "a file is not in the repository at that revision"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    """The innermost message: requests wraps urllib3's, whose text is a tuple's repr."""
    inner = exc
    while inner.args and isinstance(inner.args[0], BaseException):
        inner = inner.args[0]
    text = (inner.args[0] if inner.args and isinstance(inner.args[0], str) else str(inner)).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def download(
    expected: tuple[Expected, ...],
    *,
    local_dir: Path | None = None,
    cache_dir: Path | None = None,
    revision: str = "main",
    retries: int = 5,
    say: Callable[[str], None] = lambda line: None,
) -> Path:
    """Fetch the ``expected`` files of :data:`REPO_ID` and check each; returns the folder holding ``asset/``.

    Args:
        expected: the files and their hashes (production: ChatTTS's own map).
        local_dir: a plain folder to fetch into (``DIR/asset/…``, for ``--model-dir DIR``).
        cache_dir: where ``local_dir`` is ``None``, the hub cache to fetch into (the server's, for
            ``serve`` without ``--model-dir``).
        revision: branch, tag or commit of the repository.
        retries: how often an interrupted transfer is resumed before giving up.
        say: told one line per retry and per check.

    Raises:
        HashMismatch: a fetched file differs from its expected hash (it was deleted).
        DownloadError: the hub cannot be reached or refused, or the transfer kept failing.
    """
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        raise DownloadError("HF_HUB_OFFLINE is set, so nothing can be fetched: unset it, or copy the files")
    reason = unreachable_reason()
    if reason is not None:
        raise DownloadError(
            f"the hub {hub_endpoint()} is unreachable: {reason}; set HF_ENDPOINT to a mirror you can reach, "
            "or download on another machine and copy the folder (docs/weights.md)"
        )
    files = [f.path for f in expected]
    attempt = 0
    while True:
        try:
            folder = Path(
                snapshot_download(
                    repo_id=REPO_ID,
                    revision=revision,
                    allow_patterns=files,
                    cache_dir=cache_dir,
                    local_dir=local_dir,
                )
            )
            break
        except Exception as exc:  # huggingface_hub's and requests' errors: sorted by _permanent
            if _permanent(exc) or attempt >= retries:
                tries = f" after {attempt + 1} tries" if attempt else ""
                raise DownloadError(
                    f"fetching {REPO_ID}@{revision} from {hub_endpoint()} failed{tries}: {_reason(exc)}"
                    + ("" if _permanent(exc) else "; run the command again to resume")
                ) from None
            attempt += 1
            wait_s = min(30, 2 ** (attempt - 1))
            say(f"interrupted ({_reason(exc)}); resuming in {wait_s} s (retry {attempt} of {retries})")
            time.sleep(wait_s)
    return _checked(folder, expected, in_cache=local_dir is None, say=say)


def _checked(
    folder: Path, expected: tuple[Expected, ...], *, in_cache: bool, say: Callable[[str], None]
) -> Path:
    """Hash every file; delete those that differ and raise, naming each."""
    missing: list[Problem] = []
    bad: list[Problem] = []
    for file in expected:
        problem = check_file(folder, file)
        if problem is None:
            say(f"ok  {file.path}")
        elif problem.what.startswith("missing"):
            missing.append(problem)
        else:
            _remove(folder / file.path, in_cache=in_cache)
            bad.append(problem)
    if bad:
        names = "; ".join(f"{p.path}: {p.what}" for p in bad)
        raise HashMismatch(
            f"refused {len(bad)} fetched file(s) that differ from the expected ones, and deleted them: "
            f"{names}. The hub or mirror ({hub_endpoint()}) served other bytes; run again to fetch "
            "them anew, or try another mirror",
            bad,
        )
    if missing:
        names = ", ".join(p.path for p in missing)
        raise DownloadError(f"{REPO_ID} on {hub_endpoint()} does not have {names}: is the mirror complete?")
    return folder


def _remove(path: Path, *, in_cache: bool) -> None:
    """Delete a refused file; in the hub cache also the blob it links to, which would be reused."""
    if in_cache and path.is_symlink():
        blob = path.resolve()
        if blob.parent.name == "blobs":  # only the cache's own blob store, never a file it did not make
            blob.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
