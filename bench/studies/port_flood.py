"""Issue 25's fd probe: silent connections flood the HTTP port; does the WebSocket port still serve?

A fake-engine ``serve`` subprocess runs under an open-files limit (soft = hard = ``--nofile``);
``--silent`` TCP connections to its HTTP port send nothing. Then, while they are held, the
probe asks the WebSocket port's ``/health``, opens a WebSocket and streams a sentence, and
counts how the HTTP connections were answered (held open, refused with 503, or never
connected). ``--tree DIR`` runs the server of another checkout (``git worktree add /tmp/old
main``) for the same probe on the code before the fix.

    python -m bench.studies.port_flood --nofile 1024 --silent 1010 --out bench/results/studies/port-flood
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

from tests.serverproc import free_port

ROOT = Path(__file__).resolve().parents[2]


def _status(port: int, path: str) -> int | str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError as exc:
        return f"failed: {exc}"


async def _stream(port: int) -> str:
    try:
        async with asyncio.timeout(20), connect(f"ws://127.0.0.1:{port}/v1/stream", compression=None) as ws:
            json.loads(await ws.recv())  # hello
            await ws.send(json.dumps({"type": "start", "id": "a", "text": "Still serving.", "seed": 1}))
            while True:
                raw = await ws.recv()
                if isinstance(raw, str) and json.loads(raw)["type"] == "done":
                    return "done"
    except (OSError, TimeoutError, Exception) as exc:  # any failure is the finding
        return f"failed: {type(exc).__name__}: {exc}"


async def probe(tree: Path, nofile: int, silent: int) -> dict[str, Any]:
    """One run: the server under ``nofile`` open files, ``silent`` connections to its HTTP port."""
    port = free_port()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "server", "serve", "--engine", "fake", "--port", str(port), "--header-timeout-s", "120"),
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=limit,
    )
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    result: dict[str, Any] = {"tree": str(tree), "nofile": nofile, "silent": silent}
    try:
        async with asyncio.timeout(60):
            while await asyncio.to_thread(_status, port, "/ready") != 200:  # noqa: ASYNC110 (another process)
                await asyncio.sleep(0.2)
        never = 0
        began = time.monotonic()
        for _ in range(silent):
            try:
                async with asyncio.timeout(2):
                    held.append(await asyncio.open_connection("127.0.0.1", port + 1))
            except (TimeoutError, OSError):
                never += 1
        result["connect_s"] = round(time.monotonic() - began, 2)
        result["health"] = await asyncio.to_thread(_status, port, "/health")
        result["websocket_stream"] = await _stream(port)
        refused = open_ = 0
        for reader, _ in held:
            try:
                async with asyncio.timeout(0.05):
                    answer = await reader.read(64)
            except TimeoutError:
                open_ += 1
                continue
            refused += answer.startswith(b"HTTP/1.1 503")
        result["http"] = {"held_open": open_, "refused_503": refused, "never_connected": never}
    finally:
        for _, writer in held:
            writer.close()
        proc.terminate()
        await proc.wait()
    return result


def main() -> None:
    """Run the probe and write ``OUT.json`` and ``OUT.md``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nofile", type=int, default=1024, help="the server's open-files limit")
    parser.add_argument("--silent", type=int, default=1010, help="silent connections to the HTTP port")
    parser.add_argument("--tree", type=Path, action="append", help="checkouts to probe (default: this one)")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.silent + 256)), hard))
    runs = [asyncio.run(probe(tree.resolve(), args.nofile, args.silent)) for tree in (args.tree or [ROOT])]
    report = {
        "command": " ".join(["python -m bench.studies.port_flood", *sys.argv[1:]]),
        "load": os.getloadavg(),
    }
    report["runs"] = runs
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(text + "\n")
        lines = [
            "# Silent connections on the HTTP port vs the WebSocket port (issue 25, finding 2)",
            "",
            f"`{report['command']}`; load average {', '.join(f'{x:.1f}' for x in report['load'])}.",
            "",
            "| tree | open files | silent HTTP connections | WebSocket /health | WebSocket stream "
            "| HTTP held open | HTTP refused 503 | never connected |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for run in runs:
            http = run.get("http", {})
            lines.append(
                f"| {run['tree']} | {run['nofile']} | {run['silent']} | {run.get('health')} "
                f"| {run.get('websocket_stream')} | {http.get('held_open')} | {http.get('refused_503')} "
                f"| {http.get('never_connected')} |"
            )
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
