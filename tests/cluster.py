"""Replicas as a user runs them, behind a real load balancer: ``python -m server serve`` × N + HAProxy.

HAProxy (Debian's package) balances round-robin with no affinity, checks ``/ready`` every
100 ms like a Kubernetes readiness probe, and retries a connection that a dead replica
refuses on another one, as a Service's kube-proxy or a cloud balancer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.serverproc import free_port, spawn_server, wait_ready

HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.path.exists(p)), None
)

_CONFIG = """\
global
    maxconn 4096
    nbthread 1
defaults
    mode http
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    timeout tunnel 300s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
frontend clients
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /ready
    http-check expect status 200
    default-server inter 100ms fall 1 rise 2
{servers}
"""


@dataclass
class Replica:
    """One server process."""

    port: int
    log: Path
    proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        """Its advertise URL (what its tokens name)."""
        return f"ws://127.0.0.1:{self.port}"

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of its ``/metrics`` (blocking: call it in a thread); 0 when absent."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
            text = response.read().decode()
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0


@dataclass
class Cluster:
    """N replicas and HAProxy in front of them; ``port`` is the balancer's."""

    flags: tuple[str, ...]
    workdir: Path
    size: int = 3
    port: int = 0
    replicas: list[Replica] = field(default_factory=list)
    _haproxy: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Cluster:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATTTS_")}
        for n in range(self.size):
            replica = Replica(free_port(), self.workdir / f"replica{n}.log")
            log = replica.log.open("wb")
            flags = (
                "--engine",
                "fake",
                "--host",
                "127.0.0.1",
                "--port",
                str(replica.port),
                "--http-port",
                "0",
            )
            replica.proc = await spawn_server(*flags, *self.flags, env=env, stdout=log, stderr=log)
            log.close()
            self.replicas.append(replica)
        for replica in self.replicas:
            assert replica.proc is not None
            await wait_ready(replica.port, replica.proc)
        self.port = free_port()
        servers = "\n".join(f"    server r{n} 127.0.0.1:{r.port} check" for n, r in enumerate(self.replicas))
        config = self.workdir / "haproxy.cfg"
        config.write_text(_CONFIG.format(port=self.port, servers=servers))
        assert HAPROXY is not None
        log = (self.workdir / "haproxy.log").open("wb")
        self._haproxy = await asyncio.create_subprocess_exec(
            HAPROXY, "-db", "-f", str(config), stdout=log, stderr=log
        )
        log.close()
        async with asyncio.timeout(20):
            while not await asyncio.to_thread(_answers, self.port):
                assert self._haproxy.returncode is None, (self.workdir / "haproxy.log").read_text()
                await asyncio.sleep(0.05)

    def owner(self, url: str) -> int | None:
        """Which replica an advertise URL names."""
        return next((n for n, r in enumerate(self.replicas) if r.url == url), None)

    async def kill(self, n: int) -> None:
        """SIGKILL replica ``n`` (no drain, no goodbye: a crash or an OOM kill)."""
        proc = self.replicas[n].proc
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        await proc.wait()

    async def __aexit__(self, *exc: object) -> None:
        procs = [p for p in (self._haproxy, *(r.proc for r in self.replicas)) if p is not None]
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


def _answers(port: int) -> bool:
    """The balancer forwards a request to a ready replica (``/ready`` through it answers 200)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False
