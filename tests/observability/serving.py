"""`kvgate serve` in a subprocess over a simulated fleet, as an operator runs it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.test_cli import _free_port

SECRET = "observe-secret-5ba1"
KEY = f"ops-1.{SECRET}"
ADMIN_SECRET = "admin-secret-77c3"
ADMIN_KEY = f"root-1.{ADMIN_SECRET}"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def write_config(
    path: Path,
    urls: list[str],
    port: int,
    *,
    redis_url: str | None = None,
    server: dict[str, Any] | None = None,
    keys: dict[str, str] | None = None,
    extra_pool: list[str] | None = None,
) -> Path:
    """A config with tenant `ops` (keys: id → secret, default KEY), an admin key (ADMIN_KEY),
    a vLLM pool over `urls` serving sim-model and, given `extra_pool`, a second pool over those
    URLs serving sim-new."""
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, **(server or {})},
        "auth": {
            "admin_keys": [{"id": "root-1", "sha256": digest(ADMIN_SECRET)}],
            "tenants": [
                {
                    "name": "ops",
                    "tier": "gold",
                    "keys": [
                        {"id": key_id, "sha256": digest(secret)}
                        for key_id, secret in (keys or {"ops-1": SECRET}).items()
                    ],
                }
            ],
        },
        "pools": [
            {
                "name": "sim",
                "engine": "vllm",
                "models": ["sim-model"],
                "endpoints": [{"url": u} for u in urls],
            }
        ],
    }
    if extra_pool is not None:
        config["pools"].append(
            {
                "name": "new",
                "engine": "vllm",
                "models": ["sim-new"],
                "endpoints": [{"url": u} for u in extra_pool],
            }
        )
    if redis_url is not None:
        config["state"] = {"backend": "redis", "url": redis_url, "heartbeat_interval": 0.2}
    path.write_text(yaml.safe_dump(config))
    return path


class Serve:
    """`kvgate serve --config PATH --workers N` with stderr in a file; `lines()` reads it."""

    def __init__(
        self,
        config: Path,
        port: int,
        workers: int = 1,
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.workers = workers
        self.base = f"http://127.0.0.1:{port}"
        self.stderr_path = config.with_suffix(".stderr")
        self._stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvgate.cli",
                "serve",
                "--config",
                str(config),
                "--workers",
                str(workers),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")},
                **(env or {}),
            },
        )

    def __enter__(self) -> Serve:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                ready = httpx.get(self.base + "/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                ready = False
            if ready and self._started() == self.workers:
                return self
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"kvgate serve did not become ready:\n{self.stderr()}")

    def _started(self) -> int:
        """Worker processes that finished their start (one readiness answer shows only one)."""
        started = "Application startup complete."
        return len({line["pid"] for line in self.lines() if line.get("message") == started})

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def signal(self, signum: signal.Signals) -> None:
        self.proc.send_signal(signum)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()
        return self.proc.returncode

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def lines(self) -> list[dict[str, Any]]:
        """Every complete stderr line, parsed as JSON (fails on a line that is not); a line
        being written as this reads is left for the next call."""
        text = self.stderr()
        complete = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def free_port() -> int:
    return _free_port()


def chat(base: str, content: str = "hi", **extra: Any) -> httpx.Response:
    """A two-token chat to sim-model as tenant `ops` (KEY); `extra` goes into the body."""
    return httpx.post(
        base + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={
            "model": "sim-model",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": content}],
            **extra,
        },
        timeout=20,
    )
