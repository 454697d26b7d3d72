"""`kvgate` with a thread that writes the process's allocator figures to a file, for the soak.

    python benchmarks/heap_gauges.py FILE EVERY FRAMES serve --config ...

Every EVERY seconds it appends one JSON line to FILE: the live blocks of CPython's object
allocator (`sys.getallocatedblocks()`: every object and buffer Python holds, small or large)
and glibc's `mallinfo2()`: bytes malloc has handed out and not had back (`in_use`: sbrk heap
plus mmapped chunks) and bytes it holds free (`free`). RSS that rises while these stay flat
is memory the allocators keep after a peak (a high-water mark), not memory Python still uses;
live blocks that keep rising are a leak. Reading them costs microseconds (no walk of the heap
or of the objects), so the figures do not disturb the run they describe.

FRAMES > 0 (a diagnosis, not a measurement: tracing slows every allocation): tracemalloc
records that many frames per allocation, and each SIGUSR1 dumps a snapshot to FILE.<n>
(n = 1, 2, ...), for `tracemalloc.Snapshot.load` and `compare_to`.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import orjson

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
FIELDS += ("uordblks", "fordblks", "keepcost")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


def gauges(mallinfo2: Callable[[], MallInfo2]) -> dict[str, float]:
    info = mallinfo2()
    return {
        "t": time.monotonic(),
        "py_blocks": float(sys.getallocatedblocks()),
        "malloc_in_use": float(info.uordblks + info.hblkhd),
        "malloc_free": float(info.fordblks),
    }


def write_every(path: Path, every: float) -> None:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    with path.open("ab") as out:
        while True:
            out.write(orjson.dumps(gauges(libc.mallinfo2)) + b"\n")
            out.flush()
            time.sleep(every)


def snapshot_on_signal(path: Path) -> None:
    taken = 0

    def dump(signum: int, frame: FrameType | None) -> None:
        nonlocal taken
        taken += 1
        # Written aside and renamed: the reader waits for the name, then sees it whole.
        tracemalloc.take_snapshot().dump(f"{path}.{taken}.part")
        Path(f"{path}.{taken}.part").rename(f"{path}.{taken}")

    signal.signal(signal.SIGUSR1, dump)


def main() -> int:
    path, every, frames = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    if frames:
        tracemalloc.start(frames)
        snapshot_on_signal(path)
    threading.Thread(target=write_every, args=(path, every), daemon=True).start()
    from kvgate.cli import main as kvgate_main

    return kvgate_main(sys.argv[4:])


if __name__ == "__main__":
    sys.exit(main())
