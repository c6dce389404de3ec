"""``python -m bench.studies.image_content`` against a local index: uv resolves, range requests size.

The index is a local HTTP server that speaks PyPI's JSON simple API and answers range
requests, with small wheels made here: a ``torch`` that needs an ``nvidia-*`` wheel and a
pure-Python one, and a ``torch`` for another architecture that must not be counted.
"""

from __future__ import annotations

import functools
import http.server
import io
import json
import re
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

#: (name, version, tag, requires, files: path -> size)
WHEELS = [
    ("torch", "9.9.0", "cp311-cp311-manylinux_2_28_x86_64", ["nvidia-cublas==13.1", "filelock"],
     {"torch/lib/libtorch_cuda.so": 3000, "torch/__init__.py": 100}),
    ("torch", "9.9.0", "cp311-cp311-manylinux_2_28_aarch64", ["nvidia-cublas==13.1", "filelock"],
     {"torch/lib/libtorch_cuda.so": 900_000}),
    ("nvidia-cublas", "13.1", "py3-none-manylinux_2_27_x86_64", [],
     {"nvidia/cu13/lib/libcublas.so.13": 5000, "nvidia/cu13/lib/libcublasLt.so.13": 7000}),
    ("filelock", "3.0", "py3-none-any", [], {"filelock/__init__.py": 200}),
]  # fmt: skip


def make_wheel(
    name: str, version: str, tag: str, requires: list[str], files: dict[str, int]
) -> tuple[str, bytes]:
    dist = f"{name.replace('-', '_')}-{version}"
    metadata = "".join(
        [
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            *(f"Requires-Dist: {r}\n" for r in requires),
        ]
    )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, size in files.items():
            wheel.writestr(path, b"\0" * size)
        wheel.writestr(f"{dist}.dist-info/METADATA", metadata)
        wheel.writestr(f"{dist}.dist-info/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")
    return f"{dist}-{tag}.whl", buffer.getvalue()


class IndexHandler(http.server.BaseHTTPRequestHandler):
    """``/simple/NAME/`` as PEP 691 JSON; ``/files/WHEEL`` with HTTP range requests."""

    def __init__(self, *args: object, wheels: dict[str, tuple[str, bytes]], **kwargs: object) -> None:
        self.wheels = wheels  # filename -> (project, bytes)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.answer(head=True)

    def do_GET(self) -> None:
        self.answer(head=False)

    def answer(self, *, head: bool) -> None:
        if m := re.fullmatch(r"/simple/([^/]+)/", self.path):
            files = [
                {"filename": fn, "url": f"/files/{fn}", "size": len(data), "hashes": {}}
                for fn, (project, data) in self.wheels.items()
                if project == m.group(1)
            ]
            body = json.dumps({"meta": {"api-version": "1.0"}, "name": m.group(1), "files": files}).encode()
            return self.send(200, body, "application/vnd.pypi.simple.v1+json", head)
        name = self.path.removeprefix("/files/")
        if name not in self.wheels:
            return self.send(404, b"", "text/plain", head)
        data = self.wheels[name][1]
        if m := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
            start, end = int(m.group(1)), int(m.group(2) or len(data) - 1)
            part = data[start : end + 1]
            extra = {"Content-Range": f"bytes {start}-{start + len(part) - 1}/{len(data)}"}
            return self.send(206, part, "application/octet-stream", head, extra)
        return self.send(200, data, "application/octet-stream", head)

    def send(
        self, status: int, body: bytes, kind: str, head: bool, extra: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


@pytest.fixture
def index() -> Iterator[str]:
    wheels = {}
    for name, version, tag, requires, files in WHEELS:
        filename, data = make_wheel(name, version, tag, requires, files)
        wheels[filename] = (name, data)
    handler = functools.partial(IndexHandler, wheels=wheels)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_study_sizes_what_the_spec_installs_on_the_platform(index: str, tmp_path: Path) -> None:
    out = tmp_path / "image-content-9.9.0"
    run_ok(
        "bench.studies.image_content", "--spec", "torch==9.9.0", "--index-url", index,
        "--platform", "x86_64-manylinux_2_28", "--python-version", "3.11", "--out", str(out),
        timeout=300,
    )  # fmt: skip
    report = json.loads(Path(f"{out}.json").read_text())
    wheels = {w["name"]: w for w in report["wheels"]}
    assert set(wheels) == {"torch", "nvidia-cublas", "filelock"}
    # The x86_64 torch, not the aarch64 one; installed sizes are the files' own.
    assert wheels["torch"]["filename"].endswith("_x86_64.whl")
    assert wheels["torch"]["installed_bytes"] == 3100 + metadata_bytes(0)
    assert wheels["nvidia-cublas"]["group"] == "cuda" and wheels["filelock"]["group"] == "other"
    assert report["totals"]["cuda"]["installed_bytes"] == 12000 + metadata_bytes(2)
    assert report["libraries"] == ["libcublas.so.13", "libcublasLt.so.13", "libtorch_cuda.so"]
    markdown = Path(f"{out}.md").read_text()
    assert "| cuda | 1 |" in markdown and "`libcublasLt.so.13`" in markdown


def metadata_bytes(i: int) -> int:
    """What a wheel made here holds besides its files: its dist-info."""
    _, data = make_wheel(*WHEELS[i])
    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        return sum(info.file_size for info in wheel.infolist() if ".dist-info/" in info.filename)
