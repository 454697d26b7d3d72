"""Where a gateway's CPU goes per request: py-spy samples of kvgate under open-loop load, by part.

    flock /tmp/kvgate-bench.lock .venv/bin/python benchmarks/cpu_profile.py [--rate 300]
        [--duration 40] [--sample-rate 100] [--stream] [--answer-logprobs N] [--top 15]

kvgate (`kvgate serve`, one worker, default policy) behind benchmarks/fast_upstream.py, loaded
by benchmarks/loadgen.py at `--rate`; py-spy (the `bench` extra) samples the gateway process
with native frames while the load runs. Each sample goes to one part, by its innermost frame
that says whose work it is (the interpreter's own C frames count for the Python code they run):

    socket writes      the write/send system call (loopback TCP: the kernel's work is in it)
    uvloop (C)         the event loop in C: epoll, socket reads, timers, callbacks
    httptools (C)      HTTP/1.1 parsing, of the client's requests and of the engine's answers
    upstream client    kvgate/upstream/{h1_connection,connection_pool,transport}.py
    kvgate             the rest of kvgate: ingress, chain, routing, relay, metrics, settle
    uvicorn            uvicorn's Python (protocol, ASGI cycle)
    asyncio, stdlib    Python outside those (asyncio's tasks and futures, logging...)
    collector          the cyclic garbage collector
    other native       native frames of none of the above (libc, the allocator...)

Shares are of the samples in which the process ran (idle excluded); ms per request = share x
the process's CPU time over the requests it served during the sampling. Native sampling stops
the process for each sample: at 500 samples a second the stops let requests pile up, enough
to trigger young collections (67 in 8 s against 2 unsampled, 1.9 ms each), so the default is
100 a second, where the collector's count is the unsampled one, over a longer run.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import overhead
import services

PARTS = (
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


def part_of(stack: list[str]) -> str:
    """The part one sample goes to: `stack` is its frames, root first (py-spy's raw format,
    native frames named `function (file.c:line)` or `function (library.so)`)."""
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


def parts(raw: Path) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Samples per part, and per function of kvgate's own (the innermost kvgate frame of the
    samples in its parts), from py-spy's raw output."""
    by_part: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stacks, _, count = line.rpartition(" ")
        if not stacks:
            continue
        stack = stacks.split(";")
        if _IDLE.match(stack[-1]):
            continue
        part = part_of(stack)
        by_part[part] += int(count)
        if part not in ("kvgate", "upstream client"):
            continue
        for frame in reversed(stack):
            match = _FRAME.match(frame)
            if match and ".py:" in match["where"] and _KVGATE.search(match["where"]):
                file = match["where"].rsplit("/", 1)[-1].split(":")[0]
                by_function[f"{match['name']} ({file})"] += int(count)
                break
    return by_part, by_function


def main() -> int:
    args = parse_args()
    py_spy = shutil.which("py-spy") or str(Path(services.PYTHON).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed (the bench extra has it)", file=sys.stderr)
        return 1
    settings = overhead.Settings(args.duration + 4, 0.5, 1, args.chunks, 2.0)
    up_port, gw_port = services.free_port(), services.free_port()
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        services.fast_upstream(up_port, args.chunks, 2.0, args.answer_logprobs),
    ):
        tmp = Path(tmp_name)
        config = tmp / "kvgate.yaml"
        config.write_text(services.gateway_config(gw_port, [f"http://127.0.0.1:{up_port}"]))
        with services.gateway(config, gw_port) as gateway:
            url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            overhead.run_loadgen({"kvgate": url}, args.rate, args.stream, settings, 2.0)
            raw = tmp / "samples.txt"
            load = subprocess.Popen(
                [
                    services.PYTHON,
                    str(services.BENCH_DIR / "loadgen.py"),
                    "--target",
                    f"kvgate={url}",
                    "--rate",
                    str(args.rate),
                    "--duration",
                    str(args.duration + 4),
                    "--rounds",
                    "1",
                    "--warmup",
                    "0.5",
                    *(["--stream"] if args.stream else []),
                ],
                stdout=subprocess.DEVNULL,
            )
            time.sleep(2.0)
            cpu_before = overhead._cpu_seconds(gateway.pid)
            record = [py_spy, "record", "--pid", str(gateway.pid), "--native"]
            record += ["--rate", str(args.sample_rate), "--duration", str(int(args.duration))]
            subprocess.run(
                [*record, "--format", "raw", "--output", str(raw)], check=True, capture_output=True
            )
            cpu = overhead._cpu_seconds(gateway.pid) - cpu_before
            load.wait(timeout=120)
            by_part, by_function = parts(raw)
            if args.samples is not None:
                shutil.copy(raw, args.samples)
    requests = args.rate * args.duration
    ms_per_request = 1000 * cpu / requests
    total = sum(by_part.values())
    print(
        f"{total} samples; {ms_per_request:.3f} ms of CPU per request "
        f"({args.rate} req/s {'streaming' if args.stream else 'non-streaming'})\n"
    )
    print("| part | share | ≈ ms per request |\n|---|---|---|")
    for part in PARTS:
        share = by_part[part] / total if total else 0.0
        print(f"| {part} | {share:.0%} | {share * ms_per_request:.3f} |")
    print("\n| kvgate function (its own code) | share |\n|---|---|")
    for function, count in by_function.most_common(args.top):
        print(f"| `{function}` | {count / total:.1%} |")
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=300)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds sampled")
    parser.add_argument("--sample-rate", type=int, default=100, help="py-spy samples per s")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument(
        "--answer-logprobs",
        type=int,
        default=0,
        help="non-stream answers of this many tokens with log-probabilities (fast_upstream.py)",
    )
    parser.add_argument("--chunks", type=int, default=8, help="stream events per response")
    parser.add_argument("--top", type=int, default=15, help="kvgate functions listed")
    parser.add_argument("--samples", type=Path, help="also keep py-spy's raw samples here")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
