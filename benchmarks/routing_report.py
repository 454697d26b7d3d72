"""Tables, target checks and the plot of `routing.py`'s cells."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache_ideals import CacheIdeals
from schedule_estimates import ScheduleEstimates

COLUMN_NAMES = {"sglang": "sglang-router cache_aware", "precise": "kvgate precise (KV events)"}
LOADED = ("3x", "10x")
# First tokens slower than this (kvgate's TTFT objective, a bucket edge of its TTFT histogram)
# are counted twice per gateway cell: as the client saw them and as the gateway measured them.
SLOW_TTFT_SECONDS = 2.0


@dataclass
class Row:
    workload: str
    load: str  # "light", "3x", "10x", or "<rate> req/s" when the rates were given
    rate: float
    router: str
    stats: dict[str, Any]
    ideals: CacheIdeals
    schedules: ScheduleEstimates

    @property
    def ran(self) -> bool:
        return "unavailable" not in self.stats

    @property
    def hit_of_lru(self) -> float:
        ideal = self.ideals.fleet_lru_hit
        return self.stats["hit_cached_tokens"] / ideal if ideal else math.nan


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:+.1%}"


def progress(row: Row) -> str:
    """One line per finished cell."""
    head = f"{row.workload} {row.load} ({row.rate:g} req/s) {row.router}:"
    if not row.ran:
        return f"{head} did not run: {row.stats['unavailable']}"
    s = row.stats
    return (
        f"{head} TTFT p50 {s['ttft_p50']:.3f} p90 {s['ttft_p90']:.3f} s, hit "
        f"{s['hit_cached_tokens']:.3f} ({row.hit_of_lru:.0%} of fleet-LRU ideal "
        f"{row.ideals.fleet_lru_hit:.3f}), engines {s['loads']}, failed {s['failed']} "
        f"{s['failures'] or ''}, sim lag p99 {s['sim_lag_p99_ms']:.0f} ms"
    )


def _cell(row: Row | None) -> str:
    if row is None:
        return ""
    if not row.ran:
        return "did not run: " + row.stats["unavailable"].replace("|", "/").replace("\n", " ")
    s = row.stats
    return (
        f"{_fmt(s['ttft_p50'])} / {_fmt(s['ttft_p90'])} · {_fmt(s['hit_cached_tokens'])} "
        f"({row.hit_of_lru:.0%}) · {s['failed']}"
    )


def workload_table(rows: list[Row]) -> str:
    """Rows = loads, columns = routers."""
    routers = list(dict.fromkeys(r.router for r in rows))
    loads = list(dict.fromkeys((r.load, r.rate) for r in rows))
    by = {(r.load, r.router): r for r in rows}
    names = [COLUMN_NAMES.get(router, Path(router).stem) for router in routers]
    lines = [
        "| load | req/s | TTFT floor p50 / p90 | shortest first p50 / p90 | least-work FCFS p50 "
        "/ p90 | ideal: infinite | ideal: fleet LRU | " + " | ".join(names) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(routers),
    ]
    for load, rate in loads:
        first = next(r for r in rows if r.load == load)
        ideals, schedules = first.ideals, first.schedules
        lines.append(
            f"| {load} | {rate:g} | {ideals.ttft_floor(0.5):.3f} / {ideals.ttft_floor(0.9):.3f} "
            f"| {schedules.srpt(0.5):.3f} / {schedules.srpt(0.9):.3f} "
            f"| {schedules.fcfs(0.5):.3f} / {schedules.fcfs(0.9):.3f} "
            f"| {ideals.infinite_hit:.2f} | {ideals.fleet_lru_hit:.2f} | "
            + " | ".join(_cell(by.get((load, router))) for router in routers)
            + " |"
        )
    return "\n".join(lines)


def details_table(rows: list[Row]) -> str:
    lines = [
        "| load | router | n | failed (kinds) | TTFT p90 s, each run | TTFT p99 s | output tok/s "
        "| hit (engine) | requests per engine | max/mean | index drift | preemptions "
        f"| TTFT > {SLOW_TTFT_SECONDS:g} s: client / gateway | sim lag p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row.ran:
            continue
        s = row.stats
        kinds = ", ".join(f"{k}: {v}" for k, v in s["failures"].items())
        lines.append(
            f"| {row.load} | {row.router} | {s['requests']:.0f} | {s['failed']}"
            f"{f' ({kinds})' if kinds else ''} "
            f"| {', '.join(_fmt(p90) for p90 in s['ttft_p90_runs'])} "
            f"| {_fmt(s['ttft_p99'])} "
            f"| {_fmt(s['output_tok_s'], 0)} | {_fmt(s['hit_engine'])} "
            f"| {'/'.join(str(round(n)) for n in s['loads'])} "
            f"| {_fmt(s['max_over_mean_load'])} | {_pct(s.get('index_drift', math.nan))} "
            f"| {round(s['preemptions'])} | {s['slow_client']:.0f} / {_fmt(s['slow_gateway'], 0)} "
            f"| {_fmt(s['sim_lag_p99_ms'], 0)} |"
        )
    return "\n".join(lines)


def breakdown_table(rows: list[Row]) -> str:
    """Where the slowest tenth's first tokens went (ttft_breakdown.py), means in ms."""
    lines = [
        "Where the slowest tenth's first tokens went (requests at or above the run's TTFT p90; "
        "means in ms, medians over the runs): the floor is their own prefill of what an "
        "infinite cache misses, alone on an engine; outside the engine is the router, the "
        "sockets and the client; in the engine, waiting for a step, then their share of the "
        "steps they took part in.",
        "",
        "| load | router | n | TTFT | floor | outside the engine | waiting | step base "
        "| own prefill | others' prefill | decodes | steps running late |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row.ran or "slow_n" not in row.stats:
            continue
        s = row.stats
        parts = ("ttft", "floor", "outside", "waiting", "step_base", "own_prefill")
        parts += ("shared_prefill", "decodes", "overrun")
        lines.append(
            f"| {row.load} | {row.router} | {s['slow_n']:.0f} | "
            + " | ".join(_fmt(1000 * s[f"slow_{part}"], 0) for part in parts)
            + " |"
        )
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "holds" if ok else "misses"


def targets(rows: list[Row]) -> list[str]:
    """Issue 14's targets for kvgate on one workload, as far as these cells exercise them."""
    by = {(r.load, r.router): r for r in rows if r.ran}
    out = []
    light = [r for r in rows if r.load == "light" and r.ran]
    kv = by.get(("light", "kvgate"))
    if kv and light:
        best = min(r.stats["ttft_p50"] for r in light)
        out.append(
            f"light: TTFT p50 kvgate {kv.stats['ttft_p50']:.3f} s vs best column {best:.3f} s "
            f"({_verdict(kv.stats['ttft_p50'] <= 1.05 * best)} within 5%)"
        )
    for load in LOADED:
        kv = by.get((load, "kvgate"))
        if kv is None:
            continue
        # No schedule's p90 is below the p90 of the requests' own prefill of what even an
        # infinite cache misses (cache_ideals.py): a target under it cannot be met.
        floor = kv.ideals.ttft_floor(0.9)
        checks = []
        for router, share in (("sglang", 0.5), ("round_robin", 1 / 3)):
            other = by.get((load, router))
            if other:
                mine, theirs = kv.stats["ttft_p90"], other.stats["ttft_p90"]
                check = (
                    f"p90 kvgate {mine:.2f} s vs {router} {theirs:.2f} s "
                    f"({_verdict(mine <= share * theirs)} ≤ {share:.2g}x"
                )
                if mine > share * theirs and share * theirs < floor:
                    check += f"; unreachable: below the TTFT floor's p90 {floor:.3f} s"
                elif mine > share * theirs and share * theirs < kv.schedules.srpt(0.9):
                    check += (
                        "; below even the shortest-first schedule's p90 "
                        f"{kv.schedules.srpt(0.9):.3f} s"
                    )
                checks.append(check + ")")
        out.append(f"{load}: " + "; ".join(checks))
    for row in rows:
        if row.router == "kvgate" and row.ran:
            drift = row.stats.get("index_drift", math.nan)
            out.append(
                f"{row.load}: kvgate hit {row.hit_of_lru:.0%} of the fleet-LRU ideal "
                f"({_verdict(row.hit_of_lru >= 0.9)} ≥ 90%), {row.stats['failed']} failed "
                f"({_verdict(row.stats['failed'] == 0)} zero), index drift {_pct(drift)} of "
                f"predicted tokens ({_verdict(not drift > 0.05)} ≤ 5%)"
            )
        if row.router == "precise" and row.ran:  # issue 15's targets
            approximate = by.get((row.load, "kvgate"))
            versus = ""
            if approximate is not None:
                mine, theirs = row.stats["ttft_p90"], approximate.stats["ttft_p90"]
                versus = (
                    f", TTFT p90 {mine:.2f} s vs approximate {theirs:.2f} s "
                    f"({_verdict(mine <= theirs)} no worse)"
                )
            out.append(
                f"{row.load}: precise hit {row.hit_of_lru:.0%} of the fleet-LRU ideal "
                f"({_verdict(row.hit_of_lru >= 0.95)} ≥ 95%){versus}, {row.stats['failed']} "
                f"failed"
            )
    return [f"- {line}" for line in out]


def sections(rows: list[Row], args: argparse.Namespace, searches: dict[str, str]) -> list[str]:
    """RESULTS.md lines: per workload, the load search's probes (round-robin TTFT p90 and its
    multiple of the unloaded p90, in probe order), the table, the details and the targets."""
    out = [
        f"{args.engines} simulated {args.flavor} engines (realistic profile, speed {args.speed:g}, "
        f"{args.kv_blocks} KV blocks of 16 tokens each, max_num_seqs {args.max_num_seqs}), fresh "
        "per cell, "
        + (
            f"in one process on CPU {','.join(map(str, sorted(args.sim_cpus)))} alone (the "
            "router and the client on the others)"
            if args.sim_cpus
            else "sharing every CPU with the router and the client"
        )
        + f"; seed {args.seed}; {args.repeats} run(s) per cell (median). Cells: TTFT p50 / "
        "p90 s · prefix hit (cached_tokens / prompt tokens) (as a share of the fleet-LRU ideal) "
        "· failed requests.",
        "",
    ]
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        ideals = mine[0].ideals
        out += [
            f"### {workload}",
            "",
            f"{mine[0].stats.get('requests', '?')} requests, {ideals.prompt_tokens} prompt "
            f"tokens; blocks reused at least once (infinite cache): {ideals.reused_blocks} "
            f"({ideals.reused_blocks / args.kv_blocks:.1f}x one engine's KV, "
            f"{ideals.reused_blocks / (args.kv_blocks * args.engines):.0%} of the fleet's).",
            "",
            *(
                [f"Search on round-robin: {searches[workload]}.", ""]
                if searches.get(workload)
                else []
            ),
            workload_table(mine),
            "",
            "<details><summary>details</summary>",
            "",
            details_table(mine),
            "",
            breakdown_table(mine),
            "",
            "</details>",
            "",
            "Targets (issue 14):",
            "",
            *targets(mine),
            "",
        ]
    return out


def plot(rows: list[Row], path: Path) -> bool:
    """TTFT p90 and hit / fleet-LRU ideal against rate, per workload and router."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 8), squeeze=False)
    for col, workload in enumerate(workloads):
        for router in dict.fromkeys(r.router for r in rows):
            mine = sorted(
                (r for r in rows if r.workload == workload and r.router == router and r.ran),
                key=lambda r: r.rate,
            )
            if not mine:
                continue
            label = COLUMN_NAMES.get(router, router)
            rates = [r.rate for r in mine]
            axes[0][col].plot(rates, [r.stats["ttft_p90"] for r in mine], marker="o", label=label)
            axes[1][col].plot(rates, [r.hit_of_lru for r in mine], marker="o", label=label)
        axes[0][col].set_title(f"{workload}: TTFT p90 (s)")
        axes[0][col].set_yscale("log")
        axes[1][col].set_title(f"{workload}: hit / fleet-LRU ideal")
        axes[1][col].set_xlabel("request rate (req/s)")
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
