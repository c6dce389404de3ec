"""A loopback stand-in for the Hugging Face hub's file API, with faults a test can switch on.

It answers what ``huggingface_hub`` 0.x asks for in ``snapshot_download`` and ``hf_hub_download``:

- ``GET /api/models/{repo}/revision/{revision}``: the model info (``sha``: the commit, and the
  ``siblings`` list of files);
- ``HEAD``/``GET /{repo}/resolve/{revision}/{file}``: a small file is answered there (``ETag``,
  ``X-Repo-Commit``, ``Content-Length``); a large one, as the hub's LFS files are, with a 302 to its
  content address (``/lfs/{sha256}``) and ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``;
- ``GET /lfs/{sha256}``: the bytes, with ``Range: bytes=N-`` answered 206.

Faults: ``cut_once`` (paths whose first transfer stops part-way and the connection is closed, as a
dropped network does) and ``corrupt`` (paths served with other bytes of the same length, under the
right ETag). Every request is recorded with its headers.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/]+)$")
_RANGE = re.compile(r"^bytes=(\d+)-$")


@dataclass
class Seen:
    """One request: method, path and headers (lower-case names)."""

    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeHub:
    """The repository ``repo`` at commit :data:`COMMIT`, holding ``files`` (path → bytes)."""

    repo: str
    files: dict[str, bytes]
    #: Paths whose first transfer is cut after this many bytes (then served whole).
    cut_once: dict[str, int] = field(default_factory=dict)
    #: Paths served with wrong bytes (every byte flipped) under the right ETag and size.
    corrupt: set[str] = field(default_factory=set)
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_folder(cls, repo: str, folder: Path, paths: list[str]) -> FakeHub:
        return cls(repo, {p: (folder / p).read_bytes() for p in paths})

    def lfs(self, path: str) -> bool:
        """Large files are LFS on the hub (redirected to their content address)."""
        return path.endswith(".safetensors")

    def sha(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def body(self, path: str) -> bytes:
        data = self.files[path]
        return bytes(b ^ 0xFF for b in data) if path in self.corrupt else data

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def take_cut(self, path: str) -> int | None:
        with self._lock:
            return self.cut_once.pop(path, None)

    def gets(self, path: str) -> list[Seen]:
        """The GETs that fetched ``path``'s bytes (its content address, for a large file)."""
        url = f"/lfs/{self.sha(path)}" if self.lfs(path) else None
        return [
            s
            for s in self.seen
            if s.method == "GET"
            and (s.path == url if url else _RESOLVE.match(s.path) and s.path.endswith(path))
        ]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reads ``seen``
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, *, head: bool) -> None:
        hub = self.server.hub
        hub.record(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        if m := _INFO.match(self.path):
            if m["repo"] != hub.repo:
                return self._status(404, {"X-Error-Code": "RepoNotFound"})
            if m["rev"] not in ("main", COMMIT):
                return self._status(404, {"X-Error-Code": "RevisionNotFound"})
            info = {"id": hub.repo, "sha": COMMIT, "siblings": [{"rfilename": p} for p in hub.files]}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
        if m := _RESOLVE.match(self.path):
            path = m["path"]
            if m["repo"] != hub.repo or m["rev"] not in ("main", COMMIT):
                return self._status(404, {"X-Error-Code": "RevisionNotFound"})
            if path not in hub.files:
                return self._status(404, {"X-Error-Code": "EntryNotFound"})
            common = {"X-Repo-Commit": COMMIT}
            if hub.lfs(path):
                sha = hub.sha(path)
                host, port = self.server.server_address[:2]
                headers = {
                    **common,
                    "Location": f"http://{host}:{port}/lfs/{sha}",
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(hub.files[path])),
                    "ETag": '"redirect"',
                }
                return self._status(302, headers)
            etag = hashlib.sha1(hub.files[path]).hexdigest()
            return self._content(path, {**common, "ETag": f'"{etag}"'}, head)
        if self.path.startswith("/lfs/"):
            by_sha = {hub.sha(p): p for p in hub.files if hub.lfs(p)}
            path_or_none = by_sha.get(self.path.removeprefix("/lfs/"))
            if path_or_none is None:
                return self._status(404, {})
            return self._content(path_or_none, {"ETag": f'"{hub.sha(path_or_none)}"'}, head)
        return self._status(404, {})

    def _content(self, path: str, headers: dict[str, str], head: bool) -> None:
        hub = self.server.hub
        data = hub.body(path)
        start = 0
        status = 200
        if (r := self.headers.get("Range")) is not None and (m := _RANGE.match(r)):
            start, status = int(m[1]), 206
            headers = {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        part = data[start:]
        cut = None if head else hub.take_cut(path)
        if cut is None:
            return self._send(status, part, headers, head)
        # Promise the whole body, send part of it, close: the client sees the connection drop.
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(part))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(part[:cut])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _status(self, status: int, headers: dict[str, str]) -> None:
        self._send(status, b"", headers, head=True)

    def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: FakeHub) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub


class HubServer:
    """Serves a :class:`FakeHub` on 127.0.0.1 in a thread: ``with HubServer(hub) as url: ...``."""

    def __init__(self, hub: FakeHub) -> None:
        self._server = _Server(hub)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> str:
        self._thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
