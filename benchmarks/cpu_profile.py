"""Where a gateway's CPU goes per request: py-spy samples of kvgate under open-loop load, by part.

    flock /tmp/kvgate-bench.lock .venv/bin/python benchmarks/cpu_profile.py [--rate 300]
        [--duration 40] [--sample-rate 100] [--stream] [--answer-logprobs N] [--top 15]
        [--native]

kvgate (`kvgate serve`, one worker, default policy) behind benchmarks/fast_upstream.py, loaded
by benchmarks/loadgen.py at `--rate`; py-spy (the `bench` extra) samples the gateway process
while the load runs, without stopping it (`--nonblocking`). Each sample goes to one part by its
innermost Python frame, which also pays for the C it calls (a socket write is the line that
calls `transport.write`; the hottest lines are listed):

    upstream client    kvgate/upstream/{h1_connection,connection_pool,transport}.py
    kvgate             the rest of kvgate: ingress, chain, routing, relay, metrics, settle
    uvicorn            uvicorn's Python (protocol, ASGI cycle) and the httptools parsing it calls
    uvloop (C)         the event loop's C with no Python frame of its own: epoll, socket
                       reads, timers, callback dispatch
    asyncio, stdlib    Python outside those (asyncio's tasks and futures, logging,
                       prometheus-client...)

Shares are of the samples in which the process ran (idle excluded); ms per request = share x
the process's CPU time over the requests it served during the sampling.

Why not py-spy's default: to read a stack it stops the process, and the stops land at system
calls. `benchmarks/sampling_bias.py` shows it on a loop that spends a known share of its time
in `getpid()`: the stopping sampler puts nearly every sample there, the non-stopping one puts
the measured share there. `--native` keeps that mode for its native frames (socket writes,
uvloop and httptools in C, the collector as parts of their own): read its shares of system
calls as hugely inflated, and the rest as deflated by as much.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import overhead
import services
from pyspy_samples import NATIVE_PARTS, PARTS, Profile


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
            record = [py_spy, "record", "--pid", str(gateway.pid)]
            record.append("--native" if args.native else "--nonblocking")
            record += ["--rate", str(args.sample_rate), "--duration", str(int(args.duration))]
            subprocess.run(
                [*record, "--format", "raw", "--output", str(raw)], check=True, capture_output=True
            )
            cpu = overhead._cpu_seconds(gateway.pid) - cpu_before
            load.wait(timeout=120)
            profile = Profile(raw)
            if args.samples is not None:
                shutil.copy(raw, args.samples)
    requests = args.rate * args.duration
    ms_per_request = 1000 * cpu / requests
    total = sum(profile.by_part.values())
    mode = "native frames, the process stopped for each sample" if args.native else "non-stop"
    print(
        f"{total} samples ({mode}); {ms_per_request:.3f} ms of CPU per request "
        f"({args.rate} req/s {'streaming' if args.stream else 'non-streaming'})\n"
    )
    print("| part | share | ≈ ms per request |\n|---|---|---|")
    for part in NATIVE_PARTS if args.native else PARTS:
        share = profile.by_part[part] / total if total else 0.0
        print(f"| {part} | {share:.0%} | {share * ms_per_request:.3f} |")
    for title, counts in (
        ("kvgate function (its own code)", profile.by_function),
        ("line (innermost Python frame, with the C it calls)", profile.by_line),
    ):
        print(f"\n| {title} | share |\n|---|---|")
        for name, count in counts.most_common(args.top):
            print(f"| `{name}` | {count / total:.1%} |")
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
    parser.add_argument("--top", type=int, default=15, help="functions and lines listed")
    parser.add_argument(
        "--native",
        action="store_true",
        help="py-spy's native mode (stops the process per sample: biased to system calls)",
    )
    parser.add_argument("--samples", type=Path, help="also keep py-spy's raw samples here")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
