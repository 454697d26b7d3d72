"""Gateway overhead: open-loop load on a fast upstream, directly and through one gateway worker.

    .venv/bin/python benchmarks/overhead.py [--rates 100,300,1000] [--duration 10] [--quick]
        [--output FILE]

Starts benchmarks/fast_upstream.py and one gateway worker (`python -m kvgate.cli serve`) as
separate processes. Each measurement runs benchmarks/loadgen.py in its own process against both,
in ABBA order on the same Poisson schedule, and reports added = gateway - direct for each
percentile. First (on the fresh gateway) it searches rates upward for the highest one at which
the gateway's added p99 (unary) stays under 10 ms; then it measures every rate x mode (unary,
stream); last it probes the instrument's own ceiling (generator + upstream, direct only).
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import services

MODES = ("unary", "stream")
LAG_LIMIT_MS = 5.0  # generator send lag p99 above this: the instrument is the limit
RATE_SHORTFALL = 0.95  # achieved rate below this share of the target: same
DIRECT_P99_LIMIT_MS = 10.0  # the direct path itself is degraded above this
ADDED_P99_TARGET_MS = 10.0
SEARCH_RATES = (25, 50, 100, 200, 300, 500, 700, 1000, 1500, 2000)
CEILING_RATES = (1000, 1500, 2000, 3000, 4000)
QUIET_CPU_SHARE = 0.05  # the gateway is idle again below this share of one core
QUIET_WAIT_SECONDS = 60.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Settings:
    duration: float
    warmup: float
    rounds: int
    chunks: int
    gap_ms: float


@dataclass
class Run:
    """One rate x mode measurement: both targets' loadgen summaries and the gateway's CPU."""

    rate: int
    mode: str
    direct: dict[str, Any]
    gateway: dict[str, Any]
    gateway_cpu_ms_per_request: float

    def added(self, metric: str, pct: str) -> float | None:
        d, g = self.direct.get(metric, {}).get(pct), self.gateway.get(metric, {}).get(pct)
        return None if d is None or g is None else g - d

    def saturation(self) -> str:
        """Why the instrument (generator + upstream, seen on the direct path) cannot be trusted
        at this rate; "" when it can."""
        d = self.direct
        reasons = []
        if d["send_lag"].get("p99", 0.0) > LAG_LIMIT_MS:
            reasons.append("direct send lag")
        if d["achieved_rate"] < RATE_SHORTFALL * d["target_rate"]:
            reasons.append("direct rate short")
        key = "ttft" if self.mode == "stream" else "latency"
        if d.get(key, {}).get("p99", float("inf")) > DIRECT_P99_LIMIT_MS:
            reasons.append("direct degraded")
        if d["ok"] < d["count"]:
            reasons.append("direct failures")
        return ", ".join(reasons)

    def contention(self) -> str:
        """The generator fell behind only while the gateway ran: the gateway's CPU took the
        shared cores. Reported, but it is the gateway's cost, so the row stays meaningful."""
        if self.gateway["send_lag"].get("p99", 0.0) > LAG_LIMIT_MS:
            return f"gen lag p99 {_ms(self.gateway['send_lag']['p99'])} in gw run"
        return ""

    def flag(self) -> str:
        saturated = self.saturation()
        return f"**yes**: {saturated}" if saturated else ("no; " + self.contention()).rstrip("; ")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def run_loadgen(
    targets: dict[str, str], rate: int, stream: bool, settings: Settings, duration: float
) -> dict[str, dict[str, Any]]:
    """benchmarks/loadgen.py in its own process; its JSON summary per target."""
    args = [
        services.PYTHON,
        str(services.BENCH_DIR / "loadgen.py"),
        "--rate",
        str(rate),
        "--duration",
        str(duration),
        "--warmup",
        str(settings.warmup),
        "--rounds",
        str(settings.rounds),
    ]
    for name, url in targets.items():
        args += ["--target", f"{name}={url}"]
    if stream:
        args.append("--stream")
    budget = 60 + len(targets) * settings.rounds * (settings.warmup + duration + 15)
    done = subprocess.run(args, capture_output=True, timeout=budget, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    result: dict[str, dict[str, Any]] = orjson.loads(done.stdout)
    return result


class Bench:
    """The running upstream and gateway, and the measurements made against them."""

    def __init__(
        self, upstream_url: str, gateway_url: str, gateway_pid: int, settings: Settings
    ) -> None:
        self.targets = {"direct": upstream_url, "gateway": gateway_url}
        self.gateway_pid = gateway_pid
        self.settings = settings
        self.runs: dict[tuple[int, str], Run] = {}

    def measure(self, rate: int, mode: str, duration: float | None = None) -> Run:
        if (rate, mode) in self.runs:
            return self.runs[(rate, mode)]
        seconds = duration or self.settings.duration
        self.quiesce()
        cpu_before = _cpu_seconds(self.gateway_pid)
        result = run_loadgen(self.targets, rate, mode == "stream", self.settings, seconds)
        cpu = _cpu_seconds(self.gateway_pid) - cpu_before
        sent = rate * (seconds + self.settings.rounds * self.settings.warmup)
        run = Run(rate, mode, result["direct"], result["gateway"], 1000 * cpu / sent)
        self.runs[(rate, mode)] = run
        _progress(run)
        return run

    def quiesce(self) -> None:
        """Wait (bounded) until the gateway stops burning CPU on a previous row's backlog, so an
        overloaded row does not spill into the next one."""
        deadline = time.monotonic() + QUIET_WAIT_SECONDS
        while time.monotonic() < deadline:
            before = _cpu_seconds(self.gateway_pid)
            time.sleep(0.5)
            if _cpu_seconds(self.gateway_pid) - before < QUIET_CPU_SHARE * 0.5:
                return

    def settle(self, rate: int) -> None:
        """A discarded run, so process start-up and first connections stay out of every row."""
        run_loadgen(self.targets, rate, False, self.settings, 2.0)

    def highest_rate(self, rates: Iterable[int], duration: float) -> tuple[int | None, str]:
        """Highest rate (upward, stop at the first miss) with unary added p99 under target."""
        best: int | None = None
        for rate in rates:
            run = self.measure(rate, "unary", duration)
            added = run.added("latency", "p99")
            failed = run.gateway["ok"] < run.gateway["count"]
            if run.saturation():
                return best, f"stopped at {rate} req/s: instrument limit ({run.saturation()})"
            if failed or added is None or added >= ADDED_P99_TARGET_MS:
                why = "gateway failures" if failed else f"added p99 {_ms(added)} ms"
                return best, f"first miss at {rate} req/s ({why})"
            best = rate
        return best, "every rate tried passed"

    def ceiling(self, rates: Iterable[int], duration: float) -> list[tuple[int, dict[str, Any]]]:
        """The instrument alone (generator + upstream, direct): rates until it saturates."""
        rows = []
        for rate in rates:
            summary = run_loadgen(
                {"direct": self.targets["direct"]}, rate, False, self.settings, duration
            )["direct"]
            rows.append((rate, summary))
            print(
                f"  ceiling {rate}/s: achieved {summary['achieved_rate']:.0f}/s, "
                f"lag p99 {_ms(summary['send_lag'].get('p99'))} ms",
                file=sys.stderr,
            )
            if _instrument_saturated(summary):
                break
        return rows


def _instrument_saturated(summary: dict[str, Any]) -> bool:
    return (
        summary["send_lag"].get("p99", 0.0) > LAG_LIMIT_MS
        or summary["achieved_rate"] < RATE_SHORTFALL * summary["target_rate"]
        or summary["latency"].get("p99", float("inf")) > DIRECT_P99_LIMIT_MS
        or summary["ok"] < summary["count"]
    )


def _progress(run: Run) -> None:
    print(
        f"  {run.rate}/s {run.mode}: added p50 {_ms(run.added('latency', 'p50'))} "
        f"p99 {_ms(run.added('latency', 'p99'))} ms; saturated: {run.flag()}",
        file=sys.stderr,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fail(summary: dict[str, Any]) -> str:
    return str(summary["count"] - summary["ok"])


def _pair(run: Run, getter: Callable[[dict[str, Any]], str]) -> str:
    return f"{getter(run.direct)} / {getter(run.gateway)}"


def _lag(summary: dict[str, Any]) -> str:
    return _ms(summary["send_lag"].get("p99"))


def _pct(metric: str, pct: str) -> Callable[[dict[str, Any]], str]:
    return lambda summary: _ms(summary.get(metric, {}).get(pct))


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def unary_table(runs: list[Run]) -> str:
    header = [
        "rate/s",
        "n d/g",
        "fail d/g",
        "direct p50/p99",
        "gateway p50/p99",
        "added p50",
        "added p90",
        "added p99",
        "gw CPU ms/req",
        "lag p99 d/g",
        "instrument saturated",
    ]
    rows = [
        [
            str(r.rate),
            _pair(r, lambda s: str(s["count"])),
            _pair(r, _fail),
            f"{_ms(r.direct['latency'].get('p50'))} / {_ms(r.direct['latency'].get('p99'))}",
            f"{_ms(r.gateway['latency'].get('p50'))} / {_ms(r.gateway['latency'].get('p99'))}",
            _ms(r.added("latency", "p50")),
            _ms(r.added("latency", "p90")),
            _ms(r.added("latency", "p99")),
            f"{r.gateway_cpu_ms_per_request:.2f}",
            _pair(r, _lag),
            r.flag(),
        ]
        for r in runs
    ]
    return _table(header, rows)


def stream_table(runs: list[Run]) -> str:
    header = [
        "rate/s",
        "n d/g",
        "fail d/g",
        "TTFT direct p50/p99",
        "TTFT added p50/p90/p99",
        "total direct p50/p99",
        "total added p50/p99",
        "chunk delay p99 d/g",
        "chunk added p50/p99",
        "gw CPU ms/req",
        "lag p99 d/g",
        "instrument saturated",
    ]
    rows = []
    for r in runs:
        ttft = "/".join(_ms(r.added("ttft", p)) for p in ("p50", "p90", "p99"))
        rows.append(
            [
                str(r.rate),
                _pair(r, lambda s: str(s["count"])),
                _pair(r, _fail),
                f"{_pct('ttft', 'p50')(r.direct)} / {_pct('ttft', 'p99')(r.direct)}",
                ttft,
                f"{_pct('latency', 'p50')(r.direct)} / {_pct('latency', 'p99')(r.direct)}",
                f"{_ms(r.added('latency', 'p50'))} / {_ms(r.added('latency', 'p99'))}",
                _pair(r, _pct("chunk_delay", "p99")),
                f"{_ms(r.added('chunk_delay', 'p50'))} / {_ms(r.added('chunk_delay', 'p99'))}",
                f"{r.gateway_cpu_ms_per_request:.2f}",
                _pair(r, _lag),
                r.flag(),
            ]
        )
    return _table(header, rows)


def ceiling_table(rows: list[tuple[int, dict[str, Any]]]) -> str:
    header = [
        "target rate/s",
        "achieved/s",
        "send lag p50/p99",
        "latency p50/p99",
        "fail",
        "saturated",
    ]
    return _table(
        header,
        [
            [
                str(rate),
                f"{s['achieved_rate']:.0f}",
                f"{_pct('send_lag', 'p50')(s)} / {_lag(s)}",
                f"{_pct('latency', 'p50')(s)} / {_pct('latency', 'p99')(s)}",
                _fail(s),
                "yes" if _instrument_saturated(s) else "no",
            ]
            for rate, s in rows
        ],
    )


def failure_kinds(runs: Iterable[Run]) -> str:
    lines = [
        f"- {r.rate}/s {r.mode} {name}: " + ", ".join(f"{k} x{v}" for k, v in fails.items())
        for r in runs
        for name, summary in (("direct", r.direct), ("gateway", r.gateway))
        if (fails := summary["failures"])
    ]
    return "Failures by kind:\n" + "\n".join(lines) if lines else "No failures."


def report(
    bench: Bench,
    rates: list[int],
    search: tuple[int | None, str],
    ceiling: list[tuple[int, dict[str, Any]]],
) -> str:
    s = bench.settings
    best, why = search
    parts = [
        f"Poisson arrivals; latency from the intended send time; {s.duration:g} s measured per "
        f"target per row ({s.rounds} ABBA rounds, {s.warmup:g} s warm-up each, discarded); "
        f"stream = {s.chunks} events {s.gap_ms:g} ms apart + [DONE]. All figures in ms; "
        "added = gateway - direct at the same percentile.",
        "### Non-streaming",
        unary_table([bench.runs[(r, "unary")] for r in rates]),
        "### Streaming",
        stream_table([bench.runs[(r, "stream")] for r in rates]),
        "### Highest rate with added p99 < 10 ms (non-streaming, search upward)",
        unary_table(
            sorted((r for (_, m), r in bench.runs.items() if m == "unary"), key=lambda r: r.rate)
        ),
        f"**Highest rate with added p99 < {ADDED_P99_TARGET_MS:g} ms: "
        f"{best if best is not None else 'none'} req/s** ({why}).",
        failure_kinds(sorted(bench.runs.values(), key=lambda r: (r.rate, r.mode))),
        "### Instrument ceiling (generator + upstream, direct only)",
        ceiling_table(ceiling),
    ]
    return "\n\n".join(parts) + "\n"


def _rates(text: str) -> list[int]:
    return [int(r) for r in text.split(",") if r]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=_rates, default=[100, 300, 1000])
    parser.add_argument(
        "--duration", type=float, default=10.0, help="measured seconds per target per row"
    )
    parser.add_argument("--search-rates", type=_rates, default=list(SEARCH_RATES))
    parser.add_argument("--search-duration", type=float, default=6.0)
    parser.add_argument("--ceiling-rates", type=_rates, default=list(CEILING_RATES))
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per row")
    parser.add_argument("--chunks", type=int, default=10, help="stream events per response")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="gap between stream events")
    parser.add_argument(
        "--quick", action="store_true", help="short smoke run: 3 s rows, 2 s search, 0.5 s warm-up"
    )
    parser.add_argument("--output", type=Path, help="also write the Markdown here")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.search_duration, args.warmup = 3.0, 2.0, 0.5
    return args


def main() -> int:
    args = parse_args()
    settings = Settings(args.duration, args.warmup, args.rounds, args.chunks, args.gap_ms)
    up_port, gw_port = services.free_port(), services.free_port()
    upstream_url = f"http://127.0.0.1:{up_port}"
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory() as tmp,
        services.fast_upstream(up_port, args.chunks, args.gap_ms),
    ):
        config = Path(tmp) / "gateway.yaml"
        config.write_text(services.gateway_config(gw_port, [upstream_url]))
        with services.gateway(config, gw_port) as gw:
            bench = Bench(
                upstream_url + "/v1/chat/completions",
                f"http://127.0.0.1:{gw_port}/v1/chat/completions",
                gw.pid,
                settings,
            )
            bench.settle(min(args.rates))
            # The search goes first: rows that overload the gateway leave it degraded for a
            # while (endpoint marked unhealthy, backlog), which would spoil the low rates.
            search = bench.highest_rate(args.search_rates, args.search_duration)
            for rate in args.rates:
                for mode in MODES:
                    bench.measure(rate, mode)
        ceiling = bench.ceiling(args.ceiling_rates, args.search_duration)
    text = report(bench, args.rates, search, ceiling)
    print(text)
    print(f"(took {time.monotonic() - started:.0f} s)", file=sys.stderr)
    if args.output:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
