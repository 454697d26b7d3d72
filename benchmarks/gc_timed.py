"""`kvgate ARGS...` with every garbage collection timed, for benchmarks/gc_share.py.

    python benchmarks/gc_timed.py STATS_FILE serve --config FILE ...

Each SIGUSR1 writes to STATS_FILE, as JSON, the totals since start per generation: collections,
seconds spent in them (from `gc.callbacks`' start to stop) and objects they found unreachable.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any


def main() -> int:
    stats = Path(sys.argv[1])
    totals = {generation: {"count": 0, "seconds": 0.0, "collected": 0} for generation in range(3)}
    started = 0.0

    def timed(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
            return
        total = totals[info["generation"]]
        total["count"] += 1
        total["seconds"] += time.perf_counter() - started
        total["collected"] += info["collected"]

    gc.callbacks.append(timed)
    signal.signal(signal.SIGUSR1, lambda *_: stats.write_text(json.dumps(totals)))
    from kvgate.cli import main as kvgate

    return kvgate(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
