"""The soak benchmark cannot rot: a run of a few seconds (every phase: capacity ramp, faults,
the Redis restart, sampling) ends with 0 lost requests and readable leak figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def _row(output: str, name: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_short_soak_runs_every_phase_and_loses_nothing():
    args = ["--duration", "6", "--capacity-steps", "4", "--step-seconds", "3"]
    args += ["--sample-every", "1", "--settle", "3", "--no-plot"]
    result = subprocess.run(
        [sys.executable, str(SOAK), *args], capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "capacity 4 req/s; soak at 2 req/s" in out
    assert "redis" in out and "crash_after_tokens" in out  # the restart and the faults ran
    assert "Lost requests: 0." in out
    # The load generator's own lag, per minute and over the run, from its worker processes.
    assert re.search(r"^minute 1: [1-9][0-9]* sent", out, re.MULTILINE), out[-3000:]
    assert "load from 2 worker processes; generator lag" in out
    # The Redis link's figures come from the gateway's call-duration histogram.
    assert re.search(r"^Redis link: [1-9][0-9]* calls;", out, re.MULTILINE), out[-3000:]
    # The task count comes from the gateway's kvgate_process_asyncio_tasks gauge (-1: unread).
    # The allocator figures come from heap_gauges.py's thread in the gateway.
    for name in ("rss_mib", "fds", "tasks", "py_blocks_k", "malloc_in_use_mib"):
        idle_before, idle_after = (float(cell) for cell in _row(out, name)[9:11])
        assert idle_before > 0 and idle_after > 0
    sent = sum(int(_row(out, kind)[1]) for kind in ("stream", "plain", "drop"))
    assert sent >= 10
