"""Gateway overhead: kvgate and its peers side by side against direct calls to a fast upstream.

    flock /tmp/kvgate-bench.lock .venv/bin/python benchmarks/overhead.py [--quick]
        [--rates 100,300] [--duration 10] [--chunks 8] [--output FILE]

Starts benchmarks/fast_upstream.py, one kvgate worker (`python -m kvgate.cli serve`) and
sglang-router (the `bench` extra, started by peer_router.py with `--policy round_robin`) as
separate processes. LiteLLM's proxy (one worker, from its own virtualenv: `make .venv-litellm`,
or `--litellm PATH`; benchmarks/litellm_proxy.py) is measured after them in a pass of its own,
beside its own direct calls, at the same rates: it spends about 15 ms of CPU per request here,
so it is overloaded at rates the others hold, and the backlog it then works through would take
the CPU the other targets' turns need. Without LiteLLM installed the report says why. Each
measurement runs benchmarks/loadgen.py in its own process against every target in ABBA order on
the same Poisson schedule; added = target - direct at the same percentile, and each gateway's
CPU per request comes from its process's CPU time (all threads).

In order, on fresh gateways: every rate x mode row; the cost of a ~100k-token chat prompt
(~400 KB, end to end); the highest rate at which each gateway's added p99 stays under 10 ms
(searched upward, non-streaming, then streaming by TTFT; these end by overloading them); the
instrument's own ceiling (generator + upstream, direct only); the non-streaming search again
with nghttp2's C generator h2load (benchmarks/h2load_rates.py; skipped with the reason when it
is not installed), which reaches rates the Python one cannot; last, memory per 1,000 open,
nearly idle streams (RSS delta of new gateways in front of a slow upstream). Prints Markdown
tables, one command for all of them.

`--tracing otlp|console` measures instead what OpenTelemetry tracing costs: kvgate as
configured by default (tracing off) and kvgate tracing requests (`sample_ratio`:
`--tracing-ratio`, default 1.0: every request) side by side, rate x mode rows only. otlp
exports to benchmarks/null_collector.py (the real OTLP exporter, a collector that costs
nothing); console writes every span as JSON to /dev/null. The traced gateway's CPU per request
includes its trace exporter process, whose part is reported on its own line.

`--workers 1,2` measures instead how `kvgate serve --workers N` scales: for each N, on Redis
state (a real redis-server, as the tests start it), the highest non-streaming rate whose added
p99 stays under 10 ms, with the CPU of all its processes.

`--baseline DIR` measures a lever the same way: the kvgate of source tree DIR (the code
without the lever: `git archive main | tar -x -C DIR`) beside this tree's, rows only.

`--floor` measures instead what of kvgate's added latency is its stack and what its request
chain: benchmarks/passthrough_proxy.py (the same uvicorn server and upstream client, joined by
nothing but a body read and a relay) beside kvgate, rows only.

`--answer-logprobs N` (with any of the above) makes the upstream's non-stream answers N tokens
with five top log-probabilities each (about 300 bytes a token) instead of a small one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2load_rates
import held_streams
import litellm_proxy
import orjson
import peer_router
import services

sys.path.insert(0, str(services.BENCH_DIR.parent))
from tests.redis_server import RedisServer

MODES = ("unary", "stream")
DIRECT = "direct"
KVGATE = "kvgate"
KVGATE_TRACED = "kvgate+tracing"
KVGATE_BASELINE = "kvgate baseline"
PASSTHROUGH = "pass-through"
TRACING_TARGET = 0.05  # tracing may add this share of kvgate's added latency
SGLANG = "sglang-router"
LITELLM = litellm_proxy.NAME
LAG_LIMIT_MS = 5.0  # generator send lag p99 above this: the instrument is the limit
RATE_SHORTFALL = 0.95  # achieved rate below this share of the target: same
DIRECT_P99_LIMIT_MS = 10.0  # the direct path itself is degraded above this
ADDED_P99_TARGET_MS = 10.0
SEARCH_RATES = (100, 300, 500, 800, 1000, 1500, 2000)
LITELLM_LOW_RATES = (10, 25, 50)  # where LiteLLM's search starts
CEILING_RATES = (1000, 1500, 2000, 3000, 4000)
H2LOAD_RATES = (1000, 1500, 2000, 3000, 4000, 6000)
PROMPT_BYTES = 400_000  # ~100k tokens at ~4 bytes a token
QUIET_CPU_SHARE = 0.05  # a gateway is idle again below this share of one core
QUIET_WAIT_SECONDS = 60.0
SLOW_GAP_MS = 500.0  # held streams: one event every half second after the first
SLOW_CHUNKS = 100_000
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Settings:
    duration: float
    warmup: float
    rounds: int
    chunks: int
    gap_ms: float
    answer_logprobs: int = 0


def _key(mode: str) -> str:
    """The latency a mode is judged by: the whole answer, or a stream's first token."""
    return "ttft" if mode == "stream" else "latency"


@dataclass
class Run:
    """One rate x mode measurement: every target's loadgen summary, each gateway's CPU."""

    rate: int
    mode: str
    summaries: dict[str, dict[str, Any]]
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    # The part of it spent in each gateway's child processes (kvgate's trace exporter process,
    # or the workers of a gateway run with --workers).
    child_cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    # kvgate's own measure of its time before the upstream request (mean over the row, µs):
    # kvgate_time_to_upstream_seconds, read from each kvgate's /metrics around the row.
    to_upstream_us: dict[str, float] = field(default_factory=dict)

    @property
    def direct(self) -> dict[str, Any]:
        return self.summaries[DIRECT]

    def added(self, name: str, metric: str, pct: str) -> float | None:
        target = self.summaries.get(name, {}).get(metric, {}).get(pct)
        base = self.direct.get(metric, {}).get(pct)
        return None if target is None or base is None else target - base

    def failed(self, name: str) -> int:
        summary = self.summaries[name]
        return int(summary["count"] - summary["ok"])

    def passes(self, name: str) -> bool:
        added = self.added(name, _key(self.mode), "p99")
        return self.failed(name) == 0 and added is not None and added < ADDED_P99_TARGET_MS

    def saturation(self) -> str:
        """Why the instrument (generator + upstream, seen on the direct path) cannot be trusted
        at this rate; "" when it can."""
        d = self.direct
        reasons = []
        if d["send_lag"].get("p99", 0.0) > LAG_LIMIT_MS:
            reasons.append("direct send lag")
        if d["achieved_rate"] < RATE_SHORTFALL * d["target_rate"]:
            reasons.append("direct rate short")
        if d.get(_key(self.mode), {}).get("p99", float("inf")) > DIRECT_P99_LIMIT_MS:
            reasons.append("direct degraded")
        if d["ok"] < d["count"]:
            reasons.append("direct failures")
        return ", ".join(reasons)

    def note(self, name: str) -> str:
        """The direct row says whether the instrument is saturated; a gateway's row says when
        the generator fell behind only while that gateway ran (its CPU took the shared cores:
        its cost, so the row stays meaningful)."""
        if name == DIRECT:
            saturated = self.saturation()
            return f"**instrument saturated**: {saturated}" if saturated else "instrument ok"
        lag = self.summaries[name]["send_lag"].get("p99", 0.0)
        return f"gen lag p99 {_ms(lag)} in this run" if lag > LAG_LIMIT_MS else ""


# Per mode, a search's findings (per gateway: the highest rate held, and why it stopped) and
# the runs it made.
Searches = dict[str, tuple[dict[str, tuple[int | None, str]], list[Run]]]


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process `pid` and its descendants (a gateway's workers)."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except FileNotFoundError:  # it ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
        pending += [int(child) for child in children]
    return total


def _children_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of the live child processes of `pid` and their descendants."""
    return sum(
        _cpu_seconds(int(child))
        for listing in Path(f"/proc/{pid}/task").glob("*/children")
        for child in listing.read_text().split()
    )


def _to_upstream(url: str) -> tuple[float, float] | None:
    """The sum and count of kvgate_time_to_upstream_seconds (all routes) that the gateway
    serving `url` exports; None for a gateway without it (a peer, the pass-through)."""
    base = url.split("/v1/", 1)[0]
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as answer:
            text = answer.read().decode()
        sums = [v for _, v in services.metric_samples(text, "kvgate_time_to_upstream_seconds_sum")]
        counts = [
            v for _, v in services.metric_samples(text, "kvgate_time_to_upstream_seconds_count")
        ]
    except (OSError, ValueError):  # no /metrics, or not Prometheus text (the pass-through's)
        return None
    return (sum(sums), sum(counts)) if sums else None


def run_loadgen(
    targets: dict[str, str],
    rate: int,
    stream: bool,
    settings: Settings,
    duration: float,
    prompt_bytes: int = 0,
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
        "--prompt-bytes",
        str(prompt_bytes),
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


@dataclass(frozen=True)
class Gateway:
    url: str
    pid: int


class Bench:
    """The running upstream and gateways, and the measurements made against them."""

    def __init__(self, direct_url: str, gateways: dict[str, Gateway], settings: Settings) -> None:
        self.direct_url = direct_url
        self.gateways = gateways
        self.settings = settings
        self.runs: dict[tuple[int, str, tuple[str, ...]], Run] = {}

    def measure(
        self,
        rate: int,
        mode: str,
        names: Iterable[str] | None = None,
        duration: float | None = None,
        prompt_bytes: int = 0,
        h2load: bool = False,
    ) -> Run:
        """Direct and the gateways `names` (default: all) at `rate`, by loadgen.py or (non-
        streaming only) by h2load; reused when already measured for the same targets (and
        prompt, and generator)."""
        chosen = tuple(self.gateways if names is None else names)
        variant = mode + ("+prompt" if prompt_bytes else "") + ("+h2load" if h2load else "")
        key = (rate, variant, chosen)
        if key in self.runs:
            return self.runs[key]
        seconds = duration or self.settings.duration
        targets = {DIRECT: self.direct_url} | {n: self.gateways[n].url for n in chosen}
        self.quiesce()
        to_upstream = {n: _to_upstream(self.gateways[n].url) for n in chosen}
        before = {n: _cpu_seconds(self.gateways[n].pid) for n in chosen}
        children_before = {n: _children_cpu_seconds(self.gateways[n].pid) for n in chosen}
        if h2load:
            s = self.settings
            result = h2load_rates.run(targets, rate, seconds, s.warmup, s.rounds)
        else:
            result = run_loadgen(
                targets, rate, mode == "stream", self.settings, seconds, prompt_bytes
            )
        run = Run(rate, mode, result)
        for name in chosen:
            pid = self.gateways[name].pid
            cpu = _cpu_seconds(pid) - before[name]
            children = _children_cpu_seconds(pid) - children_before[name]
            warmup_share = self.settings.warmup * self.settings.rounds / seconds
            sent = result[name]["count"] * (1 + warmup_share)
            run.cpu_ms_per_request[name] = 1000 * cpu / sent
            run.child_cpu_ms_per_request[name] = 1000 * children / sent
            after = _to_upstream(self.gateways[name].url)
            if to_upstream[name] is not None and after is not None:
                total, count = (a - b for a, b in zip(after, to_upstream[name], strict=True))
                if count:
                    run.to_upstream_us[name] = 1e6 * total / count
        self.runs[key] = run
        _progress(run)
        return run

    def quiesce(self) -> None:
        """Wait (bounded) until no gateway burns CPU on a previous row's backlog, so an
        overloaded row does not spill into the next one."""
        deadline = time.monotonic() + QUIET_WAIT_SECONDS
        pids = [g.pid for g in self.gateways.values()]
        while time.monotonic() < deadline:
            before = sum(_cpu_seconds(p) for p in pids)
            time.sleep(0.5)
            if sum(_cpu_seconds(p) for p in pids) - before < QUIET_CPU_SHARE * 0.5:
                return

    def settle(self, rate: int) -> None:
        """A discarded run, so process start-up and first connections stay out of every row."""
        targets = {DIRECT: self.direct_url} | {n: g.url for n, g in self.gateways.items()}
        run_loadgen(targets, rate, False, self.settings, 2.0)

    def rows_prompt_searches(
        self, args: argparse.Namespace, search_rates: Iterable[int]
    ) -> tuple[dict[str, list[Run]], Run, Searches]:
        """Rows first, on fresh gateways; the ~100k-token prompt; then the searches upward
        through `search_rates`, which end by overloading them."""
        rows = {mode: [self.measure(rate, mode) for rate in args.rates] for mode in MODES}
        prompt = self.measure(
            args.prompt_rate, "unary", duration=self.settings.duration, prompt_bytes=PROMPT_BYTES
        )
        rates = list(search_rates)
        searches = {mode: self.highest_rates(mode, rates, args.search_duration) for mode in MODES}
        return rows, prompt, searches

    def highest_rates(
        self, mode: str, rates: Iterable[int], duration: float, h2load: bool = False
    ) -> tuple[dict[str, tuple[int | None, str]], list[Run]]:
        """Per gateway, the highest rate (upward, each stops at its first miss) whose added p99
        (TTFT for streams) is under the target with no failure; the runs made."""
        found: dict[str, tuple[int | None, str]] = {}
        best: dict[str, int | None] = dict.fromkeys(self.gateways)
        alive = list(self.gateways)
        runs = []
        for rate in rates:
            if not alive:
                break
            run = self.measure(rate, mode, alive, duration, h2load=h2load)
            runs.append(run)
            if run.saturation():
                why = f"stopped at {rate} req/s: instrument limit ({run.saturation()})"
                found.update({name: (best[name], why) for name in alive})
                return found, runs
            for name in list(alive):
                if run.passes(name):
                    best[name] = rate
                    continue
                failed = run.failed(name)
                added = run.added(name, _key(mode), "p99")
                why = f"{failed} failures" if failed else f"added p99 {_ms(added)} ms"
                found[name] = (best[name], f"first miss at {rate} req/s ({why})")
                alive.remove(name)
        found.update({name: (best[name], "every rate tried passed") for name in alive})
        return found, runs

    def ceiling(self, rates: Iterable[int], duration: float) -> list[tuple[int, dict[str, Any]]]:
        """The instrument alone (generator + upstream, direct): rates until it saturates."""
        rows = []
        for rate in rates:
            summary = run_loadgen({DIRECT: self.direct_url}, rate, False, self.settings, duration)[
                DIRECT
            ]
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
    key = _key(run.mode)
    parts = [
        f"{name} +{_ms(run.added(name, key, 'p50'))}/+{_ms(run.added(name, key, 'p99'))} ms "
        f"{run.cpu_ms_per_request[name]:.2f} ms CPU, {run.failed(name)} failed"
        for name in run.cpu_ms_per_request
    ]
    print(f"  {run.rate}/s {run.mode}: " + "; ".join(parts), file=sys.stderr)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(summary: dict[str, Any], metric: str) -> str:
    values = summary.get(metric, {})
    return f"{_ms(values.get('p50'))} / {_ms(values.get('p99'))}"


def _added(run: Run, name: str, metric: str) -> str:
    if name == DIRECT:
        return ""
    return f"{_ms(run.added(name, metric, 'p50'))} / {_ms(run.added(name, metric, 'p99'))}"


def _cpu(run: Run, name: str) -> str:
    cpu = run.cpu_ms_per_request.get(name)
    return "" if cpu is None else f"{cpu:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _rows(
    runs: Iterable[Run], cells: Callable[[Run, str, dict[str, Any]], list[str]]
) -> Iterator[list[str]]:
    for run in runs:
        for name, summary in run.summaries.items():
            head = [str(run.rate), name, str(summary["count"]), str(run.failed(name))]
            yield [*head, *cells(run, name, summary)]


def unary_table(runs: Iterable[Run]) -> str:
    header = ["rate/s", "target", "n", "fail", "p50 / p99", "added p50 / p99", "added p90"]
    header += ["CPU ms/req", "gen lag p99", "note"]
    return _table(
        header,
        list(
            _rows(
                runs,
                lambda r, n, s: [
                    _pct(s, "latency"),
                    _added(r, n, "latency"),
                    "" if n == DIRECT else _ms(r.added(n, "latency", "p90")),
                    _cpu(r, n),
                    _ms(s["send_lag"].get("p99")),
                    r.note(n),
                ],
            )
        ),
    )


def stream_table(runs: Iterable[Run]) -> str:
    header = ["rate/s", "target", "n", "fail", "TTFT p50 / p99", "TTFT added p50 / p99"]
    header += ["chunk delay p50 / p99", "chunk added p50 / p99", "total added p50 / p99"]
    header += ["CPU ms/req", "gen lag p99", "note"]
    return _table(
        header,
        list(
            _rows(
                runs,
                lambda r, n, s: [
                    _pct(s, "ttft"),
                    _added(r, n, "ttft"),
                    _pct(s, "chunk_delay"),
                    _added(r, n, "chunk_delay"),
                    _added(r, n, "latency"),
                    _cpu(r, n),
                    _ms(s["send_lag"].get("p99")),
                    r.note(n),
                ],
            )
        ),
    )


def search_sections(searches: Searches, heading: str) -> list[str]:
    """Each mode's search: its heading (at `heading`'s level), what it found, its runs."""
    parts = []
    for mode, (found, runs) in searches.items():
        title = "non-streaming" if mode == "unary" else "streaming, judged by TTFT"
        parts += [
            f"{heading} Highest rate, {title} (searched upward)",
            search_lines(mode, found),
            (unary_table if mode == "unary" else stream_table)(runs),
        ]
    return parts


def search_lines(mode: str, found: dict[str, tuple[int | None, str]]) -> str:
    metric = "TTFT" if mode == "stream" else "latency"
    return "\n".join(
        f"- **{name}: {best if best is not None else 'none'} req/s** with added {metric} p99 "
        f"< {ADDED_P99_TARGET_MS:g} ms and no failure ({why})."
        for name, (best, why) in found.items()
    )


def prompt_table(run: Run) -> str:
    header = ["target", "n", "fail", "p50 / p99", "added p50 / p99", "CPU ms/req"]
    header.append("req/s one core could serve")
    rows = []
    for name, summary in run.summaries.items():
        cpu = run.cpu_ms_per_request.get(name)
        rows.append(
            [
                name,
                str(summary["count"]),
                str(run.failed(name)),
                _pct(summary, "latency"),
                _added(run, name, "latency"),
                _cpu(run, name),
                "" if not cpu else f"{1000 / cpu:.0f}",
            ]
        )
    return _table(header, rows)


def memory_table(held: dict[str, held_streams.HeldStreams]) -> str:
    header = ["target", "streams held / wanted", "RSS before MB", "RSS held MB", "MB per 1,000"]
    return _table(
        header,
        [
            [
                name,
                f"{h.held} / {h.wanted}",
                f"{h.rss_before / 2**20:.1f}",
                f"{h.rss_held / 2**20:.1f}",
                f"{h.mb_per_thousand:.1f}",
            ]
            for name, h in held.items()
        ],
    )


def ceiling_table(rows: list[tuple[int, dict[str, Any]]]) -> str:
    header = ["target rate/s", "achieved/s", "send lag p50 / p99", "latency p50 / p99", "fail"]
    header.append("saturated")
    return _table(
        header,
        [
            [
                str(rate),
                f"{s['achieved_rate']:.0f}",
                _pct(s, "send_lag"),
                _pct(s, "latency"),
                str(s["count"] - s["ok"]),
                "yes" if _instrument_saturated(s) else "no",
            ]
            for rate, s in rows
        ],
    )


def failure_kinds(runs: Iterable[Run]) -> str:
    lines = [
        f"- {r.rate}/s {r.mode} {name}: " + ", ".join(f"{k} x{v}" for k, v in fails.items())
        for r in runs
        for name, summary in r.summaries.items()
        if (fails := summary["failures"])
    ]
    return "Failures by kind:\n" + "\n".join(lines) if lines else "No failed request in any run."


def peers_line(missing: dict[str, str], litellm: Path | None) -> str:
    text = f"Peers: sglang-router {peer_router.version()} (`--policy round_robin`, one process)"
    if litellm is not None:
        text += (
            f"; LiteLLM proxy {litellm_proxy.version(litellm)} (one worker, no master key, "
            "`hosted_vllm/` to the upstream)"
        )
    text += "."
    for name, why in missing.items():
        text += f" {name}: no column, {why}."
    return text


@dataclass
class Results:
    searches: Searches
    h2load: tuple[dict[str, tuple[int | None, str]], list[Run]] | str
    rows: dict[str, list[Run]]
    prompt: Run
    held: dict[str, held_streams.HeldStreams]
    ceiling: list[tuple[int, dict[str, Any]]]
    missing: dict[str, str]
    litellm: Path | None
    litellm_pass: str


def answers_note(settings: Settings) -> str:
    """What the non-stream answers were, when not the usual small one."""
    if not settings.answer_logprobs:
        return ""
    return (
        f" Non-stream answers: {settings.answer_logprobs} tokens with five top log-probabilities "
        "each (fast_upstream.py --answer-logprobs)."
    )


def report(settings: Settings, results: Results) -> str:
    s = settings
    all_runs = [r for runs in results.rows.values() for r in runs]
    all_runs += [r for _, runs in results.searches.values() for r in runs] + [results.prompt]
    parts = [
        f"Poisson arrivals; latency from the intended send time; {s.duration:g} s measured per "
        f"target per row ({s.rounds} ABBA rounds, {s.warmup:g} s warm-up each, discarded); "
        f"stream = {s.chunks} events {s.gap_ms:g} ms apart + [DONE]. All figures in ms; "
        "added = target - direct at the same percentile; CPU ms/req = the gateway process's "
        f"CPU time (user + system, all threads) over the requests sent to it.{answers_note(s)}",
        peers_line(results.missing, results.litellm),
        "### Non-streaming",
        unary_table(results.rows["unary"]),
        "### Streaming",
        stream_table(results.rows["stream"]),
    ]
    parts += search_sections(results.searches, "###")
    parts.append("### Highest rate, non-streaming, generated by h2load (searched upward)")
    if isinstance(results.h2load, str):
        parts.append(f"Not measured: {results.h2load}.")
    else:
        found, runs = results.h2load
        parts += [
            h2load_lines(),
            search_lines("unary", found),
            unary_table(runs),
        ]
        all_runs += runs
    parts += [
        f"### A ~100k-token chat prompt ({PROMPT_BYTES // 1000} KB body), non-streaming, "
        f"{results.prompt.rate} req/s",
        prompt_table(results.prompt),
        f"### Memory per 1,000 open streams (fresh gateways, upstream sends an event every "
        f"{SLOW_GAP_MS:g} ms)",
        memory_table(results.held),
        failure_kinds(all_runs),
        "### Instrument ceiling (generator + upstream, direct only)",
        ceiling_table(results.ceiling),
    ]
    if results.litellm_pass:
        parts += [
            "### LiteLLM's proxy, in a pass of its own (after the others, beside its own direct "
            "calls)",
            results.litellm_pass,
        ]
    return "\n\n".join(parts) + "\n"


def missing_peers(litellm: Path | None, left_out: bool) -> dict[str, str]:
    if left_out:
        return {LITELLM: "left out (--no-litellm)"}
    if litellm is None:
        return {LITELLM: "`litellm[proxy]` not installed (`make .venv-litellm`, or --litellm)"}
    return {}


@contextmanager
def gateways(
    tmp: Path, name: str, upstream_url: str, litellm: Path | None = None
) -> Iterator[dict[str, Gateway]]:
    """kvgate and sglang-router (and LiteLLM's proxy, run by the `litellm` executable when
    given: memory only, where the gateways are measured one after the other) in front of
    `upstream_url`, until the block ends."""
    kv_port = services.free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(services.gateway_config(kv_port, [upstream_url]))
    with ExitStack() as inner:
        kv = inner.enter_context(services.gateway(config, kv_port))
        workdir = tmp / name
        workdir.mkdir()
        sg_base, sg_pid = inner.enter_context(
            peer_router.running_router([upstream_url], workdir, "round_robin")
        )
        path = "/v1/chat/completions"
        running = {
            KVGATE: Gateway(f"http://127.0.0.1:{kv_port}{path}", kv.pid),
            SGLANG: Gateway(sg_base + path, sg_pid),
        }
        if litellm is not None:
            ll_base, ll_pid = inner.enter_context(
                litellm_proxy.running_proxy(upstream_url, "bench-model", workdir, litellm)
            )
            running[LITELLM] = Gateway(ll_base + path, ll_pid)
        yield running


def litellm_pass(tmp: Path, args: argparse.Namespace, settings: Settings, litellm: Path) -> str:
    """LiteLLM's proxy alone in front of a fresh upstream: the rows, the long prompt and both
    searches, as the main pass measures the others; its report section."""
    port = services.free_port()
    url = f"http://127.0.0.1:{port}"
    workdir = tmp / "litellm"
    workdir.mkdir()
    with (
        services.fast_upstream(port, args.chunks, args.gap_ms, args.answer_logprobs),
        litellm_proxy.running_proxy(url, "bench-model", workdir, litellm) as (base, pid),
    ):
        path = "/v1/chat/completions"
        bench = Bench(url + path, {LITELLM: Gateway(base + path, pid)}, settings)
        bench.settle(min(args.rates))
        # From well below the others' lowest rate: at ~15 ms of CPU a request it holds tens.
        rates = sorted({*LITELLM_LOW_RATES, *args.search_rates})
        rows, prompt, searches = bench.rows_prompt_searches(args, rates)
    parts = ["#### Non-streaming", unary_table(rows["unary"])]
    parts += ["#### Streaming", stream_table(rows["stream"])]
    parts += search_sections(searches, "####")
    searched = [run for _, runs in searches.values() for run in runs]
    parts += [
        f"#### A ~100k-token chat prompt, {prompt.rate} req/s",
        prompt_table(prompt),
        failure_kinds([*rows["unary"], *rows["stream"], *searched, prompt]),
    ]
    return "\n\n".join(parts)


def measure_memory(
    tmp: Path, streams: int, litellm: Path | None
) -> dict[str, held_streams.HeldStreams]:
    """Fresh gateways in front of a slow upstream; RSS with `streams` streams held open."""
    port = services.free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        services.fast_upstream(port, SLOW_CHUNKS, SLOW_GAP_MS),
        gateways(tmp, "held", url, litellm) as running,
    ):
        held = {}
        for name, gw in running.items():
            held[name] = asyncio.run(held_streams.measure(gw.url, gw.pid, streams))
            print(f"  {name}: {held[name].mb_per_thousand:.1f} MB per 1,000", file=sys.stderr)
        return held


@contextmanager
def traced_gateways(
    tmp: Path, upstream_url: str, exporter: str, ratio: float
) -> Iterator[dict[str, Gateway]]:
    """kvgate twice in front of `upstream_url`: tracing off (the default) and tracing to
    `exporter` at sample ratio `ratio`, until the block ends."""
    tracing = f"observability: {{tracing: {{exporter: {exporter}, sample_ratio: {ratio}"
    with ExitStack() as stack:
        if exporter == "otlp":
            tracing += f', endpoint: "{stack.enter_context(services.null_collector())}"'
        running = {}
        for name, extra in ((KVGATE, ""), (KVGATE_TRACED, tracing + "}}\n")):
            port = services.free_port()
            config = tmp / f"{name}.yaml"
            config.write_text(services.gateway_config(port, [upstream_url]) + extra)
            quiet = subprocess.DEVNULL if extra and exporter == "console" else None
            proc = stack.enter_context(services.gateway(config, port, quiet))
            running[name] = Gateway(f"http://127.0.0.1:{port}/v1/chat/completions", proc.pid)
        yield running


def _share(extra: float | None, base: float | None) -> str:
    if extra is None or base is None or base <= 0:
        return "-"
    return f"{100 * extra / base:+.1f}%"


def comparison_lines(runs: Iterable[Run], before: str, after: str) -> str:
    """Per row: gateway `after` against gateway `before` in added latency (p50, p99) and CPU
    per request, the change as a share of `before`'s."""
    lines = []
    for run in runs:
        key = _key(run.mode)
        cells = []
        for pct in ("p50", "p99"):
            plain = run.added(before, key, pct)
            other = run.added(after, key, pct)
            extra = None if plain is None or other is None else other - plain
            cells.append(f"{pct} {_ms(plain)} → {_ms(other)} ({_share(extra, plain)})")
        cpu = run.cpu_ms_per_request
        extra_cpu = cpu[after] - cpu[before]
        what = "added TTFT" if run.mode == "stream" else "added latency"
        line = (
            f"- {run.rate}/s {run.mode}: {what} {'; '.join(cells)}; CPU ms/req "
            f"{cpu[before]:.3f} → {cpu[after]:.3f} ({_share(extra_cpu, cpu[before])})"
        )
        own = run.to_upstream_us
        if before in own and after in own:
            line += (
                f"; time to upstream, kvgate's own mean {own[before]:.0f} → {own[after]:.0f} µs "
                f"({_share(own[after] - own[before], own[before])})"
            )
        lines.append(line)
    return "\n".join(lines)


def exporter_cpu_line(runs: Iterable[Run]) -> str:
    """The traced gateway's CPU per request spent in its trace exporter process, per row."""
    cells = [
        f"{run.rate}/s {run.mode} {run.child_cpu_ms_per_request[KVGATE_TRACED]:.3f}" for run in runs
    ]
    return "Of which in the exporter process (CPU ms/req): " + ", ".join(cells) + "."


def side_by_side(
    settings: Settings, lead: str, rows: dict[str, list[Run]], before: str, after: str
) -> tuple[list[Run], list[str]]:
    """The runs of `rows`, and the head of a report on two kvgates side by side: `lead`, the
    method, and each row's `before` → `after` comparison."""
    s = settings
    runs = [r for mode_runs in rows.values() for r in mode_runs]
    method = (
        f"Poisson arrivals; {s.duration:g} s measured per target per row ({s.rounds} ABBA "
        f"rounds, {s.warmup:g} s warm-up each, discarded); stream = {s.chunks} events "
        f"{s.gap_ms:g} ms apart + [DONE].{answers_note(s)}"
    )
    return runs, [f"{lead} {method}", comparison_lines(runs, before, after)]


def tables(rows: dict[str, list[Run]], runs: list[Run]) -> list[str]:
    """The non-streaming and streaming tables and the failures, as report parts."""
    return [
        "### Non-streaming",
        unary_table(rows["unary"]),
        "### Streaming",
        stream_table(rows["stream"]),
        failure_kinds(runs),
    ]


def tracing_report(
    settings: Settings, exporter: str, ratio: float, rows: dict[str, list[Run]]
) -> str:
    lead = (
        f"Tracing on (exporter {exporter}, sample_ratio {ratio:g}) beside tracing off; target: "
        f"tracing adds < {TRACING_TARGET:.0%} of kvgate's added latency. All figures in ms; "
        "off → on (share of off). CPU ms/req counts the gateway process and its trace "
        "exporter process (the exporter's part on the last line)."
    )
    runs, head = side_by_side(settings, lead, rows, KVGATE, KVGATE_TRACED)
    return "\n\n".join([*head, exporter_cpu_line(runs), *tables(rows, runs)]) + "\n"


@contextmanager
def baseline_gateways(tmp: Path, upstream_url: str, baseline: Path) -> Iterator[dict[str, Gateway]]:
    """The kvgate of source tree `baseline` and this tree's, same configuration, in front of
    `upstream_url`, until the block ends."""
    with ExitStack() as stack:
        running = {}
        for name, source in ((KVGATE_BASELINE, baseline), (KVGATE, None)):
            port = services.free_port()
            config = tmp / f"{name.replace(' ', '-')}.yaml"
            config.write_text(services.gateway_config(port, [upstream_url]))
            proc = stack.enter_context(services.gateway(config, port, source=source))
            running[name] = Gateway(f"http://127.0.0.1:{port}/v1/chat/completions", proc.pid)
        yield running


def baseline_report(settings: Settings, baseline: Path, rows: dict[str, list[Run]]) -> str:
    lead = (
        f"This tree's kvgate beside the kvgate of `{baseline}` (the code without the lever). "
        "All figures in ms; baseline → this tree (share of baseline)."
    )
    runs, head = side_by_side(settings, lead, rows, KVGATE_BASELINE, KVGATE)
    return "\n\n".join([*head, *tables(rows, runs)]) + "\n"


@contextmanager
def floor_gateways(tmp: Path, upstream_url: str) -> Iterator[dict[str, Gateway]]:
    """benchmarks/passthrough_proxy.py, kvgate and sglang-router, all in front of
    `upstream_url`, until the block ends."""
    with ExitStack() as stack:
        port = services.free_port()
        proxy = [str(services.BENCH_DIR / "passthrough_proxy.py"), "--port", str(port)]
        proc = stack.enter_context(
            services.service([*proxy, "--upstream", upstream_url], port, "/health")
        )
        running = {PASSTHROUGH: Gateway(f"http://127.0.0.1:{port}/v1/chat/completions", proc.pid)}
        running |= stack.enter_context(gateways(tmp, "floor", upstream_url))
        yield running


def floor_report(settings: Settings, rows: dict[str, list[Run]]) -> str:
    lead = (
        "kvgate beside a pass-through proxy on kvgate's own stack (the same uvicorn server and "
        "upstream client, nothing between them: benchmarks/passthrough_proxy.py), and "
        "sglang-router. All figures in ms; pass-through → kvgate (share of the pass-through's)."
    )
    runs, head = side_by_side(settings, lead, rows, PASSTHROUGH, KVGATE)
    return "\n\n".join([*head, *tables(rows, runs)]) + "\n"


@contextmanager
def worker_gateway(
    tmp: Path, upstream_url: str, workers: int, redis_url: str
) -> Iterator[dict[str, Gateway]]:
    """kvgate with `workers` worker processes sharing state on Redis (its own key prefix),
    until the block ends."""
    port = services.free_port()
    config = tmp / f"workers-{workers}.yaml"
    state = f'state: {{backend: redis, url: "{redis_url}", key_prefix: bench-w{workers}}}\n'
    config.write_text(services.gateway_config(port, [upstream_url]) + state)
    with services.gateway(config, port, workers=workers) as proc:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        yield {f"kvgate, {workers} worker{'s' if workers > 1 else ''}": Gateway(url, proc.pid)}


def measure_workers(
    tmp: Path, args: argparse.Namespace, settings: Settings
) -> list[tuple[int, dict[str, tuple[int | None, str]], list[Run]]]:
    """Per worker count: the highest non-streaming rate with added p99 under the target, on
    fresh gateways with Redis state, and the runs of its search."""
    up_port = services.free_port()
    upstream_url = f"http://127.0.0.1:{up_port}"
    redis = RedisServer().start()
    results = []
    try:
        with services.fast_upstream(up_port, args.chunks, args.gap_ms):
            for workers in args.workers:
                with worker_gateway(tmp, upstream_url, workers, redis.url) as running:
                    bench = Bench(upstream_url + "/v1/chat/completions", running, settings)
                    bench.settle(min(args.search_rates))
                    found, runs = bench.highest_rates(
                        "unary", args.search_rates, args.search_duration
                    )
                    results.append((workers, found, runs))
    finally:
        redis.stop()
    return results


def workers_report(
    settings: Settings, results: list[tuple[int, dict[str, tuple[int | None, str]], list[Run]]]
) -> str:
    s = settings
    best = {workers: next(iter(found.values()))[0] for workers, found, _ in results}
    parts = [
        f"`kvgate serve --workers N` on Redis state, highest non-streaming rate with added p99 "
        f"< {ADDED_P99_TARGET_MS:g} ms and no failure, searched upward on fresh gateways; "
        f"{s.duration:g} s measured per step ({s.rounds} ABBA rounds with direct calls, "
        f"{s.warmup:g} s warm-up each). CPU ms/req: all of the gateway's processes.",
    ]
    one = best.get(1)
    scaling = [
        f"{workers} workers: {rate / one:.2f}x one worker's rate"
        for workers, rate in best.items()
        if workers > 1 and rate and one
    ]
    if scaling:
        parts.append("Scaling: " + "; ".join(scaling) + ".")
    for _, found, runs in results:
        parts += [search_lines("unary", found), unary_table(runs)]
    parts.append(failure_kinds(r for _, _, runs in results for r in runs))
    return "\n\n".join(parts) + "\n"


def h2load_search(tmp: Path, args: argparse.Namespace, settings: Settings) -> str:
    """The non-streaming search with h2load alone, on fresh gateways; its report section."""
    missing = h2load_rates.available()
    if missing:
        return f"Not measured: {missing}.\n"
    up_port = services.free_port()
    upstream_url = f"http://127.0.0.1:{up_port}"
    with (
        services.fast_upstream(up_port, args.chunks, args.gap_ms, args.answer_logprobs),
        gateways(tmp, "h2load", upstream_url) as running,
    ):
        bench = Bench(upstream_url + "/v1/chat/completions", running, settings)
        bench.settle(min(args.rates))
        found, runs = bench.highest_rates(
            "unary", args.h2load_rates, args.search_duration, h2load=True
        )
    return "\n\n".join([h2load_lines(), search_lines("unary", found), unary_table(runs)]) + "\n"


def h2load_lines() -> str:
    return (
        f"`h2load --h1 --rps`, uniform arrivals, each connection at most one request per "
        f"{h2load_rates.MIN_PERIOD_MS:g} ms; latency from the actual send; no send lag column "
        "(h2load does not report it)."
    )


def _rates(text: str) -> list[int]:
    return [int(r) for r in text.split(",") if r]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=_rates, default=[100, 300])
    parser.add_argument(
        "--duration", type=float, default=10.0, help="measured seconds per target per row"
    )
    parser.add_argument("--search-rates", type=_rates, default=list(SEARCH_RATES))
    parser.add_argument("--search-duration", type=float, default=6.0)
    parser.add_argument("--ceiling-rates", type=_rates, default=list(CEILING_RATES))
    parser.add_argument(
        "--h2load-rates",
        type=_rates,
        default=list(H2LOAD_RATES),
        help="non-streaming search with h2load (skipped with a reason when not installed)",
    )
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per row")
    parser.add_argument("--chunks", type=int, default=8, help="stream events per response")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="gap between stream events")
    parser.add_argument(
        "--answer-logprobs",
        type=int,
        default=0,
        help="non-stream answers of this many tokens with log-probabilities (about 300 bytes a "
        "token) instead of a small one",
    )
    parser.add_argument("--prompt-rate", type=int, default=20, help="req/s of 100k prompts")
    parser.add_argument("--streams", type=int, default=1000, help="streams held open")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="about 2 minutes: 2 s rows and search steps, 0.5 s warm-up, fewer rates",
    )
    parser.add_argument(
        "--tracing",
        choices=("none", "otlp", "console"),
        default="none",
        help="measure tracing instead: kvgate with and without it, rows only",
    )
    parser.add_argument("--tracing-ratio", type=float, default=1.0, help="with --tracing")
    parser.add_argument(
        "--h2load-only",
        action="store_true",
        help="only the non-streaming search with h2load (--h2load-rates, --search-duration)",
    )
    parser.add_argument(
        "--workers",
        type=_rates,
        help="measure instead the highest non-streaming rate of kvgate with each of these "
        "worker counts (e.g. 1,2) on Redis state (--search-rates, --search-duration)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="measure a lever instead: beside this tree's kvgate, the kvgate of this source "
        "tree (e.g. `git archive main | tar -x -C DIR`), rows only",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="measure instead kvgate beside a pass-through proxy on its own server and client "
        "(what its stack costs, what its request chain adds), rows only",
    )
    parser.add_argument(
        "--litellm",
        type=Path,
        help="the `litellm` executable of LiteLLM's proxy (default: .venv-litellm/bin/litellm, "
        "else one on PATH; without one its column is left out)",
    )
    parser.add_argument(
        "--no-litellm", action="store_true", help="leave LiteLLM's proxy out even when installed"
    )
    parser.add_argument("--output", type=Path, help="also write the Markdown here")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.search_duration, args.warmup = 2.0, 2.0, 0.5
        args.search_rates = [r for r in args.search_rates if r >= 300][:3]
        args.ceiling_rates = args.ceiling_rates[:2]
        args.h2load_rates = args.h2load_rates[:2]
    return args


def main() -> int:
    args = parse_args()
    settings = Settings(
        args.duration, args.warmup, args.rounds, args.chunks, args.gap_ms, args.answer_logprobs
    )
    up_port = services.free_port()
    upstream_url = f"http://127.0.0.1:{up_port}"
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.workers:
            results = measure_workers(tmp, args, settings)
            return _finish(workers_report(settings, results), args, started)
        if args.h2load_only:
            return _finish(h2load_search(tmp, args, settings), args, started)
        if args.tracing != "none":
            with (
                services.fast_upstream(up_port, args.chunks, args.gap_ms, args.answer_logprobs),
                traced_gateways(tmp, upstream_url, args.tracing, args.tracing_ratio) as running,
            ):
                bench = Bench(upstream_url + "/v1/chat/completions", running, settings)
                bench.settle(min(args.rates))
                rows = {m: [bench.measure(rate, m) for rate in args.rates] for m in MODES}
            text = tracing_report(settings, args.tracing, args.tracing_ratio, rows)
            return _finish(text, args, started)
        if args.floor:
            with (
                services.fast_upstream(up_port, args.chunks, args.gap_ms, args.answer_logprobs),
                floor_gateways(tmp, upstream_url) as running,
            ):
                bench = Bench(upstream_url + "/v1/chat/completions", running, settings)
                bench.settle(min(args.rates))
                rows = {m: [bench.measure(rate, m) for rate in args.rates] for m in MODES}
            return _finish(floor_report(settings, rows), args, started)
        if args.baseline is not None:
            with (
                services.fast_upstream(up_port, args.chunks, args.gap_ms, args.answer_logprobs),
                baseline_gateways(tmp, upstream_url, args.baseline.resolve()) as running,
            ):
                bench = Bench(upstream_url + "/v1/chat/completions", running, settings)
                bench.settle(min(args.rates))
                rows = {m: [bench.measure(rate, m) for rate in args.rates] for m in MODES}
            return _finish(baseline_report(settings, args.baseline, rows), args, started)
        litellm = None if args.no_litellm else litellm_proxy.executable(args.litellm)
        with (
            services.fast_upstream(up_port, args.chunks, args.gap_ms, args.answer_logprobs),
            gateways(tmp, "bench", upstream_url) as running,
        ):
            bench = Bench(upstream_url + "/v1/chat/completions", running, settings)
            bench.settle(min(args.rates))
            rows, prompt, searches = bench.rows_prompt_searches(args, args.search_rates)
            ceiling = bench.ceiling(args.ceiling_rates, args.search_duration)
            missing_h2load = h2load_rates.available()
            h2load = missing_h2load or bench.highest_rates(
                "unary", args.h2load_rates, args.search_duration, h2load=True
            )
        held = measure_memory(tmp, args.streams, litellm)
        apart = "" if litellm is None else litellm_pass(tmp, args, settings, litellm)
    results = Results(
        searches,
        h2load,
        rows,
        prompt,
        held,
        ceiling,
        missing_peers(litellm, args.no_litellm),
        litellm,
        apart,
    )
    return _finish(report(settings, results), args, started)


def _finish(text: str, args: argparse.Namespace, started: float) -> int:
    print(text)
    print(f"(took {time.monotonic() - started:.0f} s)", file=sys.stderr)
    if args.output:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
