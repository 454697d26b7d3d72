"""Gateway CPU per request with tracing off, on but sampling nothing, and tracing every request,
closed loop (one request at a time), so the figure is each gateway process's own CPU time and
not queueing on a shared machine.

    flock /tmp/kvgate-bench.lock .venv/bin/python benchmarks/tracing_cpu.py [--rounds 8]
        [--block 300]

Starts benchmarks/fast_upstream.py, benchmarks/null_collector.py and four `kvgate serve`
processes (tracing off; otlp at `sample_ratio` 0; otlp at 1.0; otlp at 1.0 with its trace
exporter process stopped by SIGSTOP while measured, so that what remains is the gateway's own
cost without the exporter's CPU beside it on the shared cores), warms each with 200 requests,
then sends `--block` non-streaming requests to each in turn, reversing the order every round
(ABBA), and prints the CPU time (user + system, all threads) each gateway process spent per
request, and beside it that of its child processes (the trace exporter process).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import services
from overhead import _children_cpu_seconds, _cpu_seconds

_BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_WARMUP = 200
_SETTLE_SECONDS = 1.0  # longer than the gateway's 0.1 s batching of traces for the exporter
# A fourth gateway tracing every request whose exporter process is stopped (SIGSTOP) while
# measured: its gateway's own cost, without the exporter's CPU on the shared cores. What it
# is sent meanwhile waits in the gateway (up to ~6,000 requests before any drop).
_PAUSED = "every request, exporter process stopped"


def _own_cpu_seconds(pid: int) -> float:
    """The gateway process's own CPU time (overhead's figure also counts its children)."""
    return _cpu_seconds(pid) - _children_cpu_seconds(pid)


def _child_pids(pid: int) -> list[int]:
    return [
        int(child)
        for listing in Path(f"/proc/{pid}/task").glob("*/children")
        for child in listing.read_text().split()
    ]


def _tracing(traces: str, ratio: float) -> str:
    settings = f'exporter: otlp, sample_ratio: {ratio}, endpoint: "{traces}"'
    return f"observability: {{tracing: {{{settings}}}}}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=300, help="requests per gateway per round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        up_port = services.free_port()
        stack.enter_context(services.fast_upstream(up_port, 8, 0.0))
        traces = stack.enter_context(services.null_collector())
        extras = {
            "off": "",
            "sampling nothing": _tracing(traces, 0.0),
            "every request": _tracing(traces, 1.0),
            _PAUSED: _tracing(traces, 1.0),
        }
        gateways: dict[str, tuple[str, int]] = {}
        for index, (name, extra) in enumerate(extras.items()):
            port = services.free_port()
            config = tmp / f"gateway-{index}.yaml"
            config.write_text(
                services.gateway_config(port, [f"http://127.0.0.1:{up_port}"]) + extra
            )
            proc = stack.enter_context(services.gateway(config, port))
            gateways[name] = (f"http://127.0.0.1:{port}/v1/chat/completions", proc.pid)
        client = stack.enter_context(httpx.Client())
        for url, _ in gateways.values():
            for _ in range(_WARMUP):
                client.post(url, json=_BODY).raise_for_status()
        paused = _child_pids(gateways[_PAUSED][1])
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        cpu = dict.fromkeys(gateways, 0.0)
        # A child exports a moment after its gateway's block: counted over the whole run.
        time.sleep(_SETTLE_SECONDS)
        children = {name: -_children_cpu_seconds(pid) for name, (_, pid) in gateways.items()}
        for round_number in range(args.rounds):
            order = list(gateways) if round_number % 2 == 0 else list(reversed(gateways))
            for name in order:
                url, pid = gateways[name]
                before = _own_cpu_seconds(pid)
                for _ in range(args.block):
                    client.post(url, json=_BODY).raise_for_status()
                cpu[name] += _own_cpu_seconds(pid) - before
        time.sleep(_SETTLE_SECONDS)
        for name, (_, pid) in gateways.items():
            children[name] += _children_cpu_seconds(pid)
        for pid in paused:  # it exports what it was sent, then exits with its gateway
            os.kill(pid, signal.SIGCONT)
        sent = args.rounds * args.block
        base = cpu["off"] / sent
        for name, seconds in cpu.items():
            per = seconds / sent
            print(
                f"tracing {name}: {1e6 * per:.0f} µs CPU per request ({per / base - 1:+.1%}), "
                f"+ {1e6 * children[name] / sent:.0f} µs in child processes"
            )


if __name__ == "__main__":
    main()
