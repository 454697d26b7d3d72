"""Non-streaming rates beyond the Python generator, with nghttp2's C load generator `h2load`.

`h2load --h1 --rps R -c C` runs C HTTP/1.1 connections, each sending R requests a second
(uniform, not Poisson); its `--log-file` has every request's start, status and duration, from
which the same summary as loadgen.py's is built. h2load starts every connection's timer at
once, so each period opens with one request per connection together: fewer connections make
smaller bursts (measured on the direct path at 1,000 req/s: p50 3.5 to 4.5 ms with 50
connections, 1.0 ms with 10). Latency is timed from the actual send, so a connection still
waiting for its previous answer delays its next request; with a period equal to the 10 ms
target a request slower than the target is still counted as such. Targets run in ABBA order,
one segment each per round, the first `warmup` seconds of each discarded (h2load's
`--warm-up-time`).

Install: `apt-get install -y nghttp2-client`. `available()` says why it cannot run otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadgen import percentiles, request_body

MIN_PERIOD_MS = 10.0  # each connection sends at most one request per this many ms
_NS_PER_US = 1000


def available() -> str:
    """ "" when h2load can run here, else why not."""
    if shutil.which("h2load") is None:
        return "h2load not installed (apt-get install -y nghttp2-client)"
    return ""


@dataclass
class _Tally:
    latencies_ns: list[int] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    logged: int = 0
    seconds: float = 0.0


def _segment(url: str, rate: int, seconds: float, warmup: float, body: Path, tally: _Tally) -> None:
    connections = max(1, round(rate * MIN_PERIOD_MS / 1000))
    with tempfile.NamedTemporaryFile(suffix=".tsv") as log:
        done = subprocess.run(
            [
                "h2load",
                "--h1",
                f"--clients={connections}",
                f"--rps={rate / connections:g}",
                f"--duration={round(seconds * 1000)}ms",
                f"--warm-up-time={round(warmup * 1000)}ms",
                f"--data={body}",
                "--header=content-type: application/json",
                f"--log-file={log.name}",
                url,
            ],
            capture_output=True,
            timeout=seconds + warmup + 60,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"h2load failed ({done.returncode}): {done.stderr.decode()[-500:]}")
        rows = [line.split("\t") for line in Path(log.name).read_text().splitlines() if line]
    for row in rows:
        if row[1] == "200":
            tally.latencies_ns.append(int(row[2]) * _NS_PER_US)
        else:
            tally.failures[f"http {row[1]}"] += 1
    errored = _errored(done.stdout.decode())
    if errored:
        tally.failures["errored or timed out"] += errored
    tally.logged += len(rows)
    tally.seconds += seconds


def _errored(report: str) -> int:
    """Requests h2load counted as errored or timed out (they have no log line)."""
    for line in report.splitlines():
        if line.startswith("requests:"):
            fields = dict(
                (words[-1], int(words[0]))
                for part in line.split(":", 1)[1].split(",")
                if len(words := part.split()) == 2
            )
            return fields.get("errored", 0) + fields.get("timeout", 0)
    return 0


def run(
    targets: dict[str, str], rate: int, seconds: float, warmup: float, rounds: int
) -> dict[str, dict[str, Any]]:
    """Per target, loadgen.py's summary over `rounds` ABBA segments of `seconds / rounds`
    each (no send lag: h2load does not report it)."""
    tallies = {name: _Tally() for name in targets}
    with tempfile.NamedTemporaryFile(suffix=".json") as body:
        body.write(request_body(stream=False))
        body.flush()
        names = list(targets)
        for r in range(rounds):
            for name in names if r % 2 == 0 else reversed(names):
                segment = seconds / rounds
                _segment(targets[name], rate, segment, warmup, Path(body.name), tallies[name])
    return {
        name: {
            "count": len(t.latencies_ns) + sum(t.failures.values()),
            "ok": len(t.latencies_ns),
            "failures": dict(t.failures),
            "target_rate": rate,
            "achieved_rate": t.logged / t.seconds,
            "send_lag": {},
            "latency": percentiles(t.latencies_ns),
        }
        for name, t in tallies.items()
    }
