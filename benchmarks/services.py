"""Start, probe and stop the processes a benchmark needs (loopback only, bounded waits)."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

BENCH_DIR = Path(__file__).resolve().parent
PYTHON = sys.executable
READY_TIMEOUT = 15.0


def append_results(section: str) -> None:
    """Append a run's results section to this month's log, benchmarks/history/YYYY-MM.md.
    benchmarks/RESULTS.md holds the current figures per benchmark and is edited by hand."""
    history = BENCH_DIR / "history"
    history.mkdir(exist_ok=True)
    log = history / f"{datetime.datetime.now(datetime.UTC):%Y-%m}.md"
    with log.open("a") as results:
        results.write("\n" + section + "\n")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _http_ok(port: int, path: str) -> bool:
    request = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(request)
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def wait_ready(
    proc: subprocess.Popen[bytes], port: int, path: str, timeout: float = READY_TIMEOUT
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before ready")
        if _http_ok(port, path):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args!r} not ready on port {port} after {timeout} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextlib.contextmanager
def service(
    args: list[str],
    port: int,
    ready_path: str,
    stdout: int | None = None,
    source: Path | None = None,
    wrapper: Sequence[str] = (),
    ready_timeout: float = READY_TIMEOUT,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `python args...` until the block exits; ready once `GET ready_path` answers 200
    (within `ready_timeout` seconds). `stdout`: where its standard output goes (default: this
    process's); `source`: a source tree whose packages it imports first (run from there, on
    PYTHONPATH); `wrapper`: a command that runs python (valgrind, say)."""
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    proc = subprocess.Popen(
        [*wrapper, PYTHON, *args], stdin=subprocess.DEVNULL, stdout=stdout, env=env, cwd=source
    )
    try:
        wait_ready(proc, port, ready_path, ready_timeout)
        yield proc
    finally:
        stop(proc)


def fast_upstream(
    port: int, chunks: int, gap_ms: float, answer_logprobs: int = 0
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    return service(
        [
            str(BENCH_DIR / "fast_upstream.py"),
            "--port",
            str(port),
            "--chunks",
            str(chunks),
            "--gap-ms",
            str(gap_ms),
            "--answer-logprobs",
            str(answer_logprobs),
        ],
        port,
        "/health",
    )


@contextlib.contextmanager
def null_collector() -> Iterator[str]:
    """benchmarks/null_collector.py on a free port until the block ends; yields the URL its
    OTLP traces go to."""
    port = free_port()
    with service([str(BENCH_DIR / "null_collector.py"), "--port", str(port)], port, "/"):
        yield f"http://127.0.0.1:{port}/v1/traces"


def gateway_config(port: int, upstream_urls: list[str], policy: str | None = None) -> str:
    """One pool `bench` of `upstream_urls` serving `bench-model`, by `policy` (kvgate's
    default when None)."""
    endpoints = ", ".join(f'{{url: "{url}"}}' for url in upstream_urls)
    return (
        f"server: {{host: 127.0.0.1, port: {port}, access_log: false}}\n"
        "pools:\n"
        "  - name: bench\n"
        "    engine: vllm\n"
        + ("" if policy is None else f"    policy: {policy}\n")
        + "    models: [bench-model]\n"
        f"    endpoints: [{endpoints}]\n"
    )


def gateway(
    config_file: Path,
    port: int,
    stdout: int | None = None,
    source: Path | None = None,
    workers: int = 1,
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """One gateway (`kvgate serve`, `workers` processes), ready once `/readyz` answers 200;
    its code from the source tree `source` when given (default: the installed package)."""
    return service(
        ["-m", "kvgate.cli", "serve", "--config", str(config_file), "--log-level", "warning"]
        + ([] if workers == 1 else ["--workers", str(workers)]),
        port,
        "/readyz",
        stdout,
        source,
    )


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (all its threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def this_command() -> str:
    """The command line of this run as one can paste it again (quoted), and the code it ran:
    the commit, marked when the tree had changes."""
    script = Path(sys.argv[0]).resolve().relative_to(BENCH_DIR.parent)
    command = shlex.join([".venv/bin/python", str(script), *sys.argv[1:]])
    git = ["git", "-C", str(BENCH_DIR.parent)]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "kvgate", "benchmarks"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"`{command}`"
    return f"`{command}` (code {commit}{' with uncommitted changes' if dirty else ''})"


def machine() -> str:
    """Cores, CPU model and Python version, for a results section."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def metric_samples(metrics: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name` in a /metrics text."""
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == name:
                yield sample.labels, sample.value
