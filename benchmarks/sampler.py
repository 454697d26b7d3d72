"""A background thread that samples the machine and the processes under test during a run, so
a result can say whether the simulator (or the gateway) was starved of CPU.

Every `interval` seconds it records: the 1-minute load average; each watched process's CPU use
(share of one core, from /proc/<pid>/stat); the round trip of a plain `GET /health` to each
simulated engine (a busy or starved engine event loop answers late: this is its lag as seen
from outside); the engines' running / waiting sequences (from their `/metrics`); and, when a
gateway is given, its admission queue lengths (`GET /admin/admission`, open with `auth: none`).
Blocking sockets on a thread: the probe does not depend on the load generator's event loop.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_TICKS = os.sysconf("SC_CLK_TCK")
_METRIC = re.compile(r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def _get(url: str, path: str, timeout: float) -> tuple[float, bytes]:
    """Round trip in seconds and body of `GET path` (HTTP/1.1, connection: close)."""
    parts = urlsplit(url)
    start = time.perf_counter()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nhost: {parts.hostname}\r\nconnection: close\r\n\r\n".encode()
        )
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    elapsed = time.perf_counter() - start
    raw = b"".join(chunks)
    return elapsed, raw.partition(b"\r\n\r\n")[2]


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


@dataclass
class Sampler:
    """Use as a context manager around the measured phase; read `samples` or `summary()`."""

    engines: list[str]
    pids: dict[str, int]
    gateway: str | None = None
    interval: float = 0.5
    timeout: float = 5.0
    samples: list[dict[str, object]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        origin = time.perf_counter()
        cpu = {name: _cpu_seconds(pid) for name, pid in self.pids.items()}
        last = origin
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            sample: dict[str, object] = {"t": round(now - origin, 2), "load1": os.getloadavg()[0]}
            for name, pid in self.pids.items():
                used = _cpu_seconds(pid)
                before = cpu[name]
                if used is not None and before is not None:
                    sample[f"cpu_{name}"] = round((used - before) / (now - last), 3)
                cpu[name] = used
            last = now
            for i, url in enumerate(self.engines):
                try:
                    sample[f"health_ms_{i}"] = round(
                        1000 * _get(url, "/health", self.timeout)[0], 1
                    )
                    body = _get(url, "/metrics", self.timeout)[1].decode("utf-8", "replace")
                    for kind, value in _METRIC.findall(body):
                        sample[f"{kind}_{i}"] = float(value)
                except OSError:
                    sample[f"health_ms_{i}"] = None
            if self.gateway is not None:
                try:
                    state = json.loads(_get(self.gateway, "/admin/admission", self.timeout)[1])
                    sample["queued"] = state["queued"]
                except (OSError, ValueError, KeyError):
                    sample["queued"] = None
            self.samples.append(sample)

    def summary(self) -> dict[str, object]:
        """Percentiles of the engine health round trip, CPU share per process, load range."""
        health = sorted(
            v
            for s in self.samples
            for k, v in s.items()
            if k.startswith("health_ms_") and isinstance(v, float)
        )
        out: dict[str, object] = {
            "samples": len(self.samples),
            "sim_health_ms": {
                "p50": _pick(health, 0.5),
                "p99": _pick(health, 0.99),
                "max": health[-1] if health else None,
                "failed": sum(
                    1
                    for s in self.samples
                    for k, v in s.items()
                    if k.startswith("health_ms_") and v is None
                ),
            },
            "load1": {
                "min": min((float(s["load1"]) for s in self.samples), default=None),
                "max": max((float(s["load1"]) for s in self.samples), default=None),
            },
        }
        for name in self.pids:
            shares = [float(s[f"cpu_{name}"]) for s in self.samples if f"cpu_{name}" in s]
            out[f"cpu_{name}"] = {
                "mean": round(sum(shares) / len(shares), 2) if shares else None,
                "max": max(shares, default=None),
            }
        return out


def _pick(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
