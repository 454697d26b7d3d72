"""The cyclic garbage collector's share of a gateway's CPU under load.

    flock /tmp/kvgate-bench.lock .venv/bin/python benchmarks/gc_share.py [--rates 300]
        [--duration 8] [--rounds 2] [--baseline DIR] [--tracing]

kvgate behind benchmarks/fast_upstream.py under the open-loop load of benchmarks/overhead.py
(loadgen.py, direct calls as the baseline, ABBA rounds), each gateway process run through
benchmarks/gc_timed.py, which times every collection with `gc.callbacks`. Per gateway and row:
collections per 1,000 requests by generation, the objects they found unreachable per request,
the collector's time per request and its share of the gateway process's CPU time (its trace
exporter process left out). `--baseline DIR` adds the kvgate of source tree DIR (e.g. `git
archive main | tar -x -C DIR`) beside this tree's; `--tracing` adds this tree's kvgate tracing
every request to benchmarks/null_collector.py (OTLP).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import overhead
import services

THIS_TREE = "kvgate"
BASELINE = "kvgate baseline"
TRACED = "kvgate+tracing"


@contextmanager
def timed_gateways(
    tmp: Path, upstream_url: str, baseline: Path | None, tracing: bool
) -> Iterator[tuple[dict[str, overhead.Gateway], dict[str, Path]]]:
    """This tree's kvgate (and the baseline's, and a traced one) with their collections timed;
    the gateways and the stats file of each."""
    trees: dict[str, tuple[Path | None, str]] = {THIS_TREE: (None, "")}
    if baseline is not None:
        trees = {BASELINE: (baseline.resolve(), ""), **trees}
    with ExitStack() as stack:
        if tracing:
            endpoint = stack.enter_context(services.null_collector())
            tracing = f'exporter: otlp, sample_ratio: 1, endpoint: "{endpoint}"'
            trees[TRACED] = (None, f"observability: {{tracing: {{{tracing}}}}}\n")
        running, stats = {}, {}
        for name, (source, extra) in trees.items():
            port = services.free_port()
            slug = name.replace(" ", "-")
            config = tmp / f"{slug}.yaml"
            config.write_text(services.gateway_config(port, [upstream_url]) + extra)
            stats[name] = tmp / f"{slug}.gc.json"
            args = [str(services.BENCH_DIR / "gc_timed.py"), str(stats[name]), "serve"]
            args += ["--config", str(config), "--log-level", "warning"]
            proc = stack.enter_context(services.service(args, port, "/readyz", source=source))
            running[name] = overhead.Gateway(
                f"http://127.0.0.1:{port}/v1/chat/completions", proc.pid
            )
        yield running, stats


def snapshot(gateways: dict[str, overhead.Gateway], stats: dict[str, Path]) -> dict[str, Any]:
    """Every gateway's collector totals now."""
    for name, gateway in gateways.items():
        stats[name].unlink(missing_ok=True)
        os.kill(gateway.pid, signal.SIGUSR1)
    taken = {}
    for name in gateways:
        deadline = time.monotonic() + 10
        while not stats[name].exists() or not stats[name].read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} wrote no collector totals")
            time.sleep(0.02)
        taken[name] = json.loads(stats[name].read_text())
    return taken


def row(
    run: overhead.Run,
    name: str,
    before: dict[str, Any],
    after: dict[str, Any],
    settings: overhead.Settings,
) -> str:
    """The table row of gateway `name` in `run`, from its collector totals around it."""
    sent = run.summaries[name]["count"]
    cpu_ms = run.cpu_ms_per_request[name] - run.child_cpu_ms_per_request[name]
    # The warm-up requests ran too: counted as overhead.py counts them for CPU per request.
    requests = (1 + settings.warmup * settings.rounds / settings.duration) * sent
    diffs = {
        g: {k: after[g][k] - before[g][k] for k in ("count", "seconds", "collected")} for g in after
    }
    per_1000 = " / ".join(f"{1000 * diffs[g]['count'] / requests:.1f}" for g in sorted(diffs))
    collected = sum(d["collected"] for d in diffs.values()) / requests
    gc_ms = 1000 * sum(d["seconds"] for d in diffs.values()) / requests
    share = gc_ms / cpu_ms if cpu_ms else 0.0
    key = overhead._key(run.mode)
    p50, p99 = (overhead._ms(run.added(name, key, pct)) for pct in ("p50", "p99"))
    return (
        f"| {run.rate} | {run.mode} | {name} | {sent} | {p50} / {p99} | {cpu_ms:.3f} | "
        f"{per_1000} | {collected:.1f} | {1000 * gc_ms:.1f} | {share:.1%} |"
    )


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    settings = overhead.Settings(args.duration, args.warmup, args.rounds, args.chunks, args.gap_ms)
    up_port = services.free_port()
    upstream_url = f"http://127.0.0.1:{up_port}"
    lines = [
        "| rate/s | mode | target | n | added p50 / p99 ms | CPU ms/req | collections per 1,000 "
        "req, gen 0 / 1 / 2 | unreachable objects per req | µs of GC per req | GC share of CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        services.fast_upstream(up_port, args.chunks, args.gap_ms),
        timed_gateways(Path(tmp_name), upstream_url, args.baseline, args.tracing) as (
            running,
            stats,
        ),
    ):
        bench = overhead.Bench(upstream_url + "/v1/chat/completions", running, settings)
        bench.settle(min(args.rates))
        for mode in overhead.MODES:
            for rate in args.rates:
                bench.quiesce()
                before = snapshot(running, stats)
                run = bench.measure(rate, mode)
                after = snapshot(running, stats)
                lines += [row(run, name, before[name], after[name], settings) for name in running]
    print("\n".join(lines))
    print(f"(took {time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=overhead._rates, default=[300])
    parser.add_argument("--duration", type=float, default=8.0, help="measured s per target")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per row")
    parser.add_argument("--chunks", type=int, default=8, help="stream events per response")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="gap between stream events")
    parser.add_argument("--baseline", type=Path, help="a source tree measured beside this one")
    parser.add_argument("--tracing", action="store_true", help="add a gateway tracing everything")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
