"""py-spy's raw samples (`py-spy record --format raw`) read by part, function and line.

One line per distinct stack: its frames root first, `;`-separated, then the sample count. A
Python frame is `function (path/file.py:line)`; with `--native`, C frames are `function
(file.c:line)` or `function (library.so)`. `benchmarks/cpu_profile.py` prints what this counts.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

PARTS = ("upstream client", "kvgate", "uvicorn", "uvloop (C)", "asyncio, stdlib")
NATIVE_PARTS = (
    "socket writes",
    "uvloop (C)",
    "httptools (C)",
    "upstream client",
    "kvgate",
    "uvicorn",
    "asyncio, stdlib",
    "collector",
    "other native",
)
_CLIENT = re.compile(r"(^|/)kvgate/upstream/(h1_connection|connection_pool|transport)\.py")
_KVGATE = re.compile(r"(^|/)kvgate/")
_UVICORN = re.compile(r"(^|/)uvicorn/")
_WRITES = re.compile(r"^(__GI_)?_*(libc_)?(write|writev|send|sendmsg|sendto)$")
_GC = re.compile(
    r"^gc_collect|^collect_with_callback$|^visit_(decref|reachable)$|^move_unreachable$"
)
# uvloop's Cython loop and the libuv inside it; httptools' Cython parser and llhttp.
_UVLOOP_FILES = re.compile(r"^(loop|core|linux|stream|tcp|loop-watcher|timer|poll|async)\.c:")
_HTTPTOOLS_FILES = re.compile(r"^(parser|llhttp|api|http|url_parser)\.c:")
# The loop waiting for events: the process is idle (py-spy's native mode samples it too).
_IDLE = re.compile(r"^epoll_p?wait \(")
_FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")
# The innermost Python frame while uvloop runs its own C: `asyncio.run`'s runner.
_LOOP = re.compile(r"(^|/)asyncio/runners\.py:")


def part_of(stack: list[str]) -> str:
    """The part one sample goes to: `stack` is its frames, root first (py-spy's raw format,
    native frames, with `--native`, named `function (file.c:line)` or `function (library.so)`)."""
    for frame in reversed(stack):
        match = _FRAME.match(frame)
        name, where = (match["name"], match["where"]) if match else (frame, "")
        if ".py:" in where:
            if _CLIENT.search(where):
                return "upstream client"
            if _KVGATE.search(where):
                return "kvgate"
            if _UVICORN.search(where):
                return "uvicorn"
            if _LOOP.search(where):
                return "uvloop (C)"
            return "asyncio, stdlib"
        if _WRITES.match(name):
            return "socket writes"
        if _GC.search(name):
            return "collector"
        if _HTTPTOOLS_FILES.match(where) or "llhttp" in name:
            return "httptools (C)"
        if where.startswith("_asynciomodule.c"):
            return "asyncio, stdlib"
        if _UVLOOP_FILES.match(where):
            return "uvloop (C)"
        # Anything else (the interpreter, libc, the allocator) works for its caller.
    return "other native"


class Profile:
    """Samples per part, per function of kvgate's own (the innermost kvgate frame of the
    samples in its parts) and per line (the innermost Python frame, with what it calls), from
    py-spy's raw output."""

    def __init__(self, raw: Path) -> None:
        self.by_part: collections.Counter[str] = collections.Counter()
        self.by_function: collections.Counter[str] = collections.Counter()
        self.by_line: collections.Counter[str] = collections.Counter()
        for line in raw.read_text().splitlines():
            stacks, _, count = line.rpartition(" ")
            if not stacks:
                continue
            stack = stacks.split(";")
            if _IDLE.match(stack[-1]):
                continue
            samples = int(count)
            part = part_of(stack)
            self.by_part[part] += samples
            python = [m for m in map(_FRAME.match, stack) if m and ".py:" in m["where"]]
            if python:
                innermost = python[-1]
                self.by_line[f"{innermost['name']} ({_short(innermost['where'])})"] += samples
            if part in ("kvgate", "upstream client"):
                mine = next(m for m in reversed(python) if _KVGATE.search(m["where"]))
                file = _short(mine["where"]).split(":")[0]
                self.by_function[f"{mine['name']} ({file})"] += samples


def _short(where: str) -> str:
    """`kvgate/upstream/h1_connection.py:137` from py-spy's path, for kvgate, uvicorn and the
    standard library alike: the path from the package down."""
    for anchor in ("kvgate/", "uvicorn/", "asyncio/", "prometheus_client/"):
        at = where.rfind(anchor)
        if at >= 0:
            return where[at:]
    return where.rsplit("/", 1)[-1]
