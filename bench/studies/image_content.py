"""What a container image's Python environment holds for one torch build (issue #45: the GPU image).

``python -m bench.studies.image_content --spec torch==2.13.0 --out PREFIX`` resolves the spec
for the image's platform without installing anything (``uv pip compile --python-platform``),
then, for every pinned wheel, takes its download size from the index's JSON page (PEP 691)
and its installed size and shared libraries from the wheel's zip directory, read with HTTP
range requests (the end of each file only, not gigabytes of wheels). It writes PREFIX.json
and PREFIX.md: every wheel, the totals per group (torch, triton, the CUDA libraries of the
``nvidia-*`` and ``cuda-*`` wheels, the rest) and the CUDA libraries by soname, which is what
a CUDA base image would duplicate.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

TIMEOUT_S = 60
GROUPS = ("torch", "triton", "cuda", "other")
#: A shared library in a wheel: ``nvidia/cu13/lib/libcublas.so.13``, ``torch/lib/libgomp.so.1``.
LIBRARY = re.compile(r"(^|/)(lib[\w.+-]*?\.so(\.\d+)*)$")


class RangeFile(io.RawIOBase):
    """A remote file, read with HTTP range requests (zipfile seeks to its end for the directory)."""

    def __init__(self, url: str) -> None:
        self.url = url
        head = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(head, timeout=TIMEOUT_S) as response:
            self.size = int(response.headers["Content-Length"])
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = start + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        end = min(self.pos + len(view), self.size)
        if end <= self.pos:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            if response.status != 206:
                raise OSError(f"{self.url}: the server ignores range requests (HTTP {response.status})")
            data = response.read()
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)


def resolve(spec: str, index_url: str, platform: str, python_version: str) -> list[tuple[str, str]]:
    """``(name, version)`` of every package the spec installs on the platform, by uv's resolver."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if not uv:
        raise SystemExit("uv is needed (scripts/setup.sh installs it into .venv)")
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.in"
        requirements.write_text(spec + "\n")
        done = subprocess.run(
            [uv, "pip", "compile", "--quiet", "--no-config", "--no-header", "--no-annotate",
             "--index-url", index_url, "--python-platform", platform, "--python-version", python_version,
             str(requirements)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"uv pip compile failed:\n{done.stderr}")
    pins = [line.split("==", 1) for line in done.stdout.splitlines() if "==" in line]
    return [(name.strip(), version.strip()) for name, version in pins]


def fits(tags: Iterable[Tag], python_version: str, arch: str) -> bool:
    """Whether a wheel's tags install on CPython ``python_version`` on Linux ``arch``."""
    cp = "cp" + python_version.replace(".", "")
    major = "py" + python_version.split(".")[0]
    for tag in tags:
        interpreter = tag.interpreter in (cp, major, "py" + python_version.replace(".", ""))
        abi = tag.abi in (cp, "abi3", "none")
        platform = tag.platform == "any" or ("linux" in tag.platform and tag.platform.endswith(arch))
        if interpreter and abi and platform:
            return True
    return False


def wheel_file(index_url: str, name: str, version: str, python_version: str, arch: str) -> dict[str, Any]:
    """The index's file entry of the wheel that pip would install (filename, url, size)."""
    url = f"{index_url.rstrip('/')}/{canonicalize_name(name)}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        page = json.load(response)
    found = []
    for entry in page["files"]:
        if not entry["filename"].endswith(".whl"):
            continue
        _, wheel_version, _, tags = parse_wheel_filename(entry["filename"])
        if str(wheel_version) == version and fits(tags, python_version, arch):
            found.append({**entry, "url": urllib.parse.urljoin(url, entry["url"])})
    if not found:
        raise SystemExit(f"{name}=={version}: no wheel for CPython {python_version} on Linux {arch} at {url}")
    # Several manylinux tags of one build differ by bytes: the largest is the upper bound.
    return max(found, key=lambda entry: int(entry["size"]))


def group(name: str) -> str:
    name = canonicalize_name(name)
    if name in ("torch", "triton"):
        return name
    return "cuda" if name.startswith(("nvidia-", "cuda-")) else "other"


def measure(
    pins: list[tuple[str, str]], index_url: str, python_version: str, arch: str
) -> list[dict[str, Any]]:
    wheels = []
    for name, version in pins:
        entry = wheel_file(index_url, name, version, python_version, arch)
        with zipfile.ZipFile(io.BufferedReader(RangeFile(entry["url"]), buffer_size=1 << 20)) as wheel:
            infos = wheel.infolist()
        libraries = sorted(i.filename for i in infos if LIBRARY.search(i.filename))
        wheels.append(
            {
                "name": name,
                "version": version,
                "group": group(name),
                "filename": entry["filename"],
                "download_bytes": int(entry["size"]),
                "installed_bytes": sum(i.file_size for i in infos),
                "libraries": libraries,
            }
        )
        print(
            f"{name}=={version}: {wheels[-1]['installed_bytes'] / 2**20:.0f} MiB installed", file=sys.stderr
        )
    return wheels


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def report(args: argparse.Namespace, wheels: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    totals = {
        g: {
            "wheels": sum(1 for w in wheels if w["group"] == g),
            "download_bytes": sum(w["download_bytes"] for w in wheels if w["group"] == g),
            "installed_bytes": sum(w["installed_bytes"] for w in wheels if w["group"] == g),
        }
        for g in GROUPS
    }
    all_download = sum(t["download_bytes"] for t in totals.values())
    all_installed = sum(t["installed_bytes"] for t in totals.values())
    cuda_libraries = sorted(
        {Path(lib).name for w in wheels if w["group"] in ("cuda", "torch") for lib in w["libraries"]}
    )
    data = {
        "spec": args.spec,
        "index_url": args.index_url,
        "platform": args.platform,
        "python_version": args.python_version,
        "totals": totals,
        "download_bytes": all_download,
        "installed_bytes": all_installed,
        "libraries": cuda_libraries,
        "wheels": wheels,
    }
    lines = [
        f"# What `{args.spec}` installs on {args.platform}, CPython {args.python_version}",
        "",
        f"Resolved by `uv pip compile` from {args.index_url}; sizes from the index (download) and the",
        "wheels' zip directories (installed), in MiB. Command: `python -m bench.studies.image_content"
        f" --spec {args.spec} --index-url {args.index_url} --platform {args.platform}"
        f" --python-version {args.python_version} --out PREFIX`.",
        "",
        "| group | wheels | download | installed |",
        "|---|---|---|---|",
        *(
            f"| {g} | {t['wheels']} | {mib(t['download_bytes'])} | {mib(t['installed_bytes'])} |"
            for g, t in totals.items()
        ),
        f"| all | {len(wheels)} | {mib(all_download)} | {mib(all_installed)} |",
        "",
        "`cuda`: the `nvidia-*` and `cuda-*` wheels, the CUDA libraries torch loads from the environment.",
        "",
        "## Every wheel",
        "",
        "| wheel | group | download | installed |",
        "|---|---|---|---|",
        *(
            f"| {w['name']}=={w['version']} | {w['group']} | {mib(w['download_bytes'])}"
            f" | {mib(w['installed_bytes'])} |"
            for w in sorted(wheels, key=lambda w: -w["installed_bytes"])
        ),
        "",
        "## Shared libraries of torch and the CUDA wheels",
        "",
        ", ".join(f"`{name}`" for name in cuda_libraries) or "none",
        "",
    ]
    return data, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.image_content", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--spec", default="torch==2.13.0", help="what the image installs (a requirement)")
    parser.add_argument(
        "--index-url", default="https://pypi.org/simple", help="a simple index with its JSON API"
    )
    parser.add_argument("--platform", default="x86_64-manylinux_2_28", help="uv's --python-platform")
    parser.add_argument("--python-version", default="3.11")
    parser.add_argument("--out", required=True, type=Path, help="PREFIX: writes PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    arch = args.platform.split("-")[0]
    pins = resolve(args.spec, args.index_url, args.platform, args.python_version)
    data, markdown = report(args, measure(pins, args.index_url, args.python_version, arch))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Not with_suffix: a PREFIX may end in a version ("...-2.13.0").
    Path(f"{args.out}.json").write_text(json.dumps(data, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(markdown)
    print(f"wrote {args.out}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
