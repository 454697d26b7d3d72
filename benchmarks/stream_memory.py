"""Where a held stream's memory goes: Python allocations of kvgate per open stream, by line.

    flock /tmp/kvgate-bench.lock .venv/bin/python benchmarks/stream_memory.py [--streams 1000]

Serves kvgate in this process (uvicorn on uvloop, as `kvgate serve` does) with tracemalloc on,
in front of benchmarks/fast_upstream.py sending one event every 500 ms; a client process
(this script with `--hold`) opens the streams and holds them. Prints the RSS growth per 1,000
streams (held once without tracing), then the Python allocations per 1,000 held streams (held
again under tracemalloc) and the lines that made most of them (a snapshot diff; a warm-up batch
of streams first, so caches and pools filled once are not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import held_streams
import services
import uvicorn
import yaml

SLOW_CHUNKS = 100_000
SLOW_GAP_MS = 500.0


def hold(url: str, count: int) -> None:
    """Client role: open `count` streams, print how many are held, close them at EOF."""

    async def run() -> None:
        writers = await held_streams._hold(url, count, 30.0)
        print(len(writers), flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await held_streams._release(writers)

    asyncio.run(run())


def _held(url: str, count: int) -> tuple[subprocess.Popen[str], int]:
    client = subprocess.Popen(
        [services.PYTHON, __file__, "--hold", url, "--streams", str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    return client, int(client.stdout.readline())


def _release(client: subprocess.Popen[str]) -> None:
    assert client.stdin is not None
    client.stdin.close()
    client.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--top", type=int, default=25, help="lines shown")
    parser.add_argument("--hold", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        hold(args.hold, args.streams)
        return 0
    from kvgate.app import GatewayApp
    from kvgate.config import parse_config

    up_port, gw_port = services.free_port(), services.free_port()
    with services.fast_upstream(up_port, SLOW_CHUNKS, SLOW_GAP_MS):
        config = parse_config(
            yaml.safe_load(services.gateway_config(gw_port, [f"http://127.0.0.1:{up_port}"]))
        )
        server = uvicorn.Server(
            uvicorn.Config(
                GatewayApp(config),
                host="127.0.0.1",
                port=gw_port,
                loop="uvloop",
                http="httptools",
                log_level="warning",
                access_log=False,
            )
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        _release(_held(url, 100)[0])  # warm-up: pools, caches, first-use allocations
        time.sleep(1.0)
        rss_before = services.rss_bytes(os.getpid())
        client, held_untraced = _held(url, args.streams)
        time.sleep(1.0)  # a few more events relayed on every stream
        rss_held = services.rss_bytes(os.getpid())
        _release(client)
        time.sleep(1.0)
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        client, held = _held(url, args.streams)
        time.sleep(1.0)
        after = tracemalloc.take_snapshot()
        _release(client)
        server.should_exit = True
        thread.join(timeout=10)
    stats = after.compare_to(before, "lineno")
    traced = sum(s.size_diff for s in stats)
    rss = (rss_held - rss_before) / 2**20 * 1000 / max(1, held_untraced)
    print(f"streams held: {held_untraced}, then {held} traced, of {args.streams}")
    print(f"RSS growth (untraced): {rss:.1f} MB per 1,000 streams")
    print(f"traced Python allocations: {traced / 2**20 * 1000 / max(1, held):.1f} MB per 1,000")
    print("\n| KB per 1,000 streams | blocks per stream | where |\n|---|---|---|")
    for stat in stats[: args.top]:
        frame = stat.traceback[0]
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        print(
            f"| {stat.size_diff / 1024 * 1000 / max(1, held):.0f} | "
            f"{stat.count_diff / max(1, held):.1f} | {where} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
