"""`kvgate` with a thread that writes the process's allocator figures to a file, for the soak.

    python benchmarks/heap_gauges.py FILE EVERY serve --config ...

Every EVERY seconds it appends one JSON line to FILE: the live blocks of CPython's object
allocator (`sys.getallocatedblocks()`: every object and buffer Python holds, small or large)
and glibc's `mallinfo2()`: bytes malloc has handed out and not had back (`in_use`: sbrk heap
plus mmapped chunks) and bytes it holds free (`free`). RSS that rises while these stay flat
is memory the allocators keep after a peak (a high-water mark), not memory Python still uses;
live blocks that keep rising are a leak. Reading them costs microseconds (no walk of the heap
or of the objects), so the figures do not disturb the run they describe.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

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


def main() -> int:
    path, every, argv = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    threading.Thread(target=write_every, args=(path, every), daemon=True).start()
    from kvgate.cli import main as kvgate_main

    return kvgate_main(argv)


if __name__ == "__main__":
    sys.exit(main())
