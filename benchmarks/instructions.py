"""Instructions per request: kvgate's cost counted by valgrind, not timed, so that a lever worth
a few µs shows on a noisy machine.

    flock /tmp/kvgate-bench.lock .venv/bin/python benchmarks/instructions.py [--requests 400]
        [--warmup 100] [--repeats 2] [--stream] [--baseline DIR] [--no-passthrough]
        [--policy NAME] [--chunks 8] [--gap-ms 5] [--tracing]

Each target runs under `valgrind --tool=callgrind` (it counts every instruction the process
executes, the interpreter's and the C libraries' alike; system calls' kernel work is not
counted) behind benchmarks/fast_upstream.py, which runs natively. One client in this process
sends `--warmup` requests, then callgrind's counters are zeroed (`callgrind_control -z`),
then `--requests` more, one at a time on one keep-alive connection, and the counters are
dumped: instructions per request is the dump's total over `--requests`. The same code on the
same requests counts within a fraction of a percent from run to run, whatever else the machine
does, where time per request moves by tens of percent (benchmarks/RESULTS.md).

Targets: `benchmarks/passthrough_proxy.py` (kvgate's server and upstream client with nothing
between them: the stack's floor), kvgate (`kvgate serve`, one worker, this tree; the default
policy, or `--policy`) and, with `--baseline DIR`, the kvgate of source tree DIR in the same
way (the code without a lever). With `--tracing` every kvgate traces every request to
`null_collector.py` over OTLP; its exporter process is exec'd, so it runs natively and is not
counted: a run with and one without give what tracing costs the serving process. Health probes and
telemetry scrapes are set to a minute apart, so the count is the requests' own work; the
client sends `loadgen.py`'s request.

What it does not show: time. A lever that saves instructions but waits longer (a deferred
write, a lock) is for `overhead.py` to judge. Under valgrind the process runs about 50 times
slower, so a run takes a minute or two.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import loadgen
import services

READY_SECONDS = 180.0
PASSTHROUGH = "pass-through"
KVGATE = "kvgate"
KVGATE_BASELINE = "kvgate baseline"


def gateway_yaml(port: int, upstream: str, policy: str | None, traces: str | None) -> str:
    """`services.gateway_config` with the background probes a minute apart, tracing every
    request to the OTLP URL `traces` when given."""
    config = services.gateway_config(port, [upstream], policy)
    config += "health: {interval: 60}\nrouting: {scrape_interval: 60}\n"
    if traces is not None:
        config += f'observability: {{tracing: {{exporter: otlp, endpoint: "{traces}"}}}}\n'
    return config


def under_callgrind(
    args: list[str], port: int, out: Path, source: Path | None = None
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """`python args...` under callgrind (its counts to `out`), ready once `GET /readyz`
    answers 200 (the pass-through answers any GET)."""
    wrapper = ["valgrind", "-q", "--tool=callgrind", f"--callgrind-out-file={out}"]
    return services.service(
        args, port, "/readyz", subprocess.DEVNULL, source, wrapper, READY_SECONDS
    )


def send(connection: http.client.HTTPConnection, body: bytes, count: int) -> None:
    """`count` requests, one at a time, each answer read to its end."""
    headers = {"content-type": "application/json"}
    for _ in range(count):
        connection.request("POST", "/v1/chat/completions", body, headers)
        answer = connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"answer {answer.status}")


def count(proc: subprocess.Popen[bytes], out: Path, port: int, args: argparse.Namespace) -> float:
    """Instructions per request over `args.requests` requests after `args.warmup`."""
    body = loadgen.request_body(args.stream)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        send(connection, body, args.warmup)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        send(connection, body, args.requests)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    finally:
        connection.close()
    dumps = sorted(out.parent.glob(f"{out.name}.*"), key=lambda p: int(p.suffix[1:]))
    return _total(dumps[-1]) / args.requests


def _total(dump: Path) -> int:
    """The instructions a callgrind dump counted (its `summary:` line)."""
    for line in dump.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {dump}")


def target_args(
    name: str, port: int, upstream: str, tmp: Path, policy: str | None, traces: str | None
) -> list[str]:
    if name == PASSTHROUGH:
        proxy = str(services.BENCH_DIR / "passthrough_proxy.py")
        return [proxy, "--port", str(port), "--upstream", upstream]
    config = tmp / f"{name.replace(' ', '-')}.yaml"
    config.write_text(gateway_yaml(port, upstream, policy, traces))
    return ["-m", "kvgate.cli", "serve", "--config", str(config), "--log-level", "warning"]


def main() -> int:
    args = parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (Debian: apt install valgrind)", file=sys.stderr)
        return 1
    targets: dict[str, Path | None] = {} if args.no_passthrough else {PASSTHROUGH: None}
    if args.baseline is not None:
        targets[KVGATE_BASELINE] = args.baseline.resolve()
    targets[KVGATE] = None
    counts: dict[str, list[float]] = {name: [] for name in targets}
    up_port = services.free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(services.fast_upstream(up_port, args.chunks, args.gap_ms))
        traces = stack.enter_context(services.null_collector()) if args.tracing else None
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for run in range(args.repeats):
            for name, source in targets.items():
                port = services.free_port()
                out = tmp / f"callgrind-{run}-{name.replace(' ', '-')}"
                launch = target_args(name, port, upstream, tmp, args.policy, traces)
                with under_callgrind(launch, port, out, source) as proc:
                    counts[name].append(count(proc, out, port, args))
    print(report(counts, args))
    return 0


def report(counts: dict[str, list[float]], args: argparse.Namespace) -> str:
    kind = (
        f"streams of {args.chunks} events {args.gap_ms:g} ms apart"
        if args.stream
        else "non-streaming requests"
    )
    lines = [
        f"Instructions per request (thousands), {args.requests} {kind} after {args.warmup} "
        f"of warm-up, each run on a fresh process; {args.repeats} run(s) per target, each "
        f"run's count, then the median.{' kvgate traces every request.' if args.tracing else ''}",
        "",
        "| target | each run | median |",
        "|---|---|---|",
    ]
    medians = {name: statistics.median(values) for name, values in counts.items()}
    for name, values in counts.items():
        runs = ", ".join(f"{v / 1000:,.1f}" for v in values)
        lines.append(f"| {name} | {runs} | {medians[name] / 1000:,.1f} |")
    if PASSTHROUGH in medians:
        chain = medians[KVGATE] - medians[PASSTHROUGH]
        lines.append("")
        lines.append(
            f"kvgate's chain on top of the stack: {chain / 1000:,.1f} thousand instructions "
            f"per request (kvgate in all {medians[KVGATE] / medians[PASSTHROUGH]:.2f}x the "
            "pass-through)."
        )
    if KVGATE_BASELINE in medians:
        saved = medians[KVGATE_BASELINE] - medians[KVGATE]
        lines.append("")
        lines.append(
            f"This tree against `{args.baseline}`: {-saved / 1000:+,.1f} thousand instructions "
            f"per request ({-saved / medians[KVGATE_BASELINE]:+.1%})."
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests counted per run")
    parser.add_argument("--warmup", type=int, default=100, help="requests before counting")
    parser.add_argument("--repeats", type=int, default=2, help="runs per target")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--chunks", type=int, default=8, help="stream events per response")
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=5.0,
        help="ms between a stream's events (apart, each is a read and a relay of its own)",
    )
    parser.add_argument("--baseline", type=Path, help="source tree of the kvgate to compare")
    parser.add_argument("--no-passthrough", action="store_true", help="skip the pass-through")
    parser.add_argument("--policy", help="the pool's routing policy (default: kvgate's)")
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="every kvgate traces every request to an OTLP collector (null_collector.py)",
    )
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
