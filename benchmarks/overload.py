"""Overload: 2-3x the simulated fleet's capacity, 20% interactive / 80% batch, with and without
kvgate's admission control, side by side on fresh identical fleets.

    .venv/bin/python benchmarks/overload.py [--load 2.5] [--duration 30] [--engines 2]

1. Calibrate: closed loop straight to the engines with `engines x max_num_seqs` workers on the
   same request mix; capacity = completed requests per second.
2. For each mode, on a fresh simulated fleet (realistic profile, speed 1, max_num_seqs 8) and a
   fresh `kvgate serve`: open-loop Poisson arrivals at `load x capacity` for `duration` s.
   `admission`: endpoints capped at max_num_seqs in flight, classes from an `x-lane` header,
   batch deadline 20 s. `none`: `admission.enabled: false`, no in-flight cap (a plain proxy:
   the engines queue everything, as vLLM does). Resilience defaults in both (the pool's
   adaptive throttle on).
3. Report, from each request's intended send time: interactive TTFT (first generated text)
   percentiles and the share within the SLO (2 s), how many requests of each class were shed
   (503) and completed, batch work that was served but finished late or was cut at its
   deadline, and goodput = requests per second that completed within their SLO (interactive:
   first token within 2 s; batch: all tokens within its 20 s deadline) as a share of capacity,
   also counted in output tokens (capacity x the mix's mean output tokens).
4. Whether the instruments were starved (`sampler.py`): engine `/health` round trips, CPU share
   of the simulator, gateway and generator processes, the load average, and the generator's
   own event-loop lag. `--dump FILE` keeps every request's result and the probe's samples.

Also prints the classifier's cost per request (microbenchmark, in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvloop
from sampler import Sampler
from services import free_port, gateway, service

from kvgate.chain.classify import Classifier
from kvgate.chain.settings import DEFAULT_TIERS, ClassificationConfig, TenantConfig
from kvgate.chain.tenants import build_tenant
from kvgate.ingress import request_context

MODEL = "sim-model"
MAX_NUM_SEQS = 8
INTERACTIVE_SHARE = 0.2
TOKENS = {"interactive": 32, "batch": 96}
TTFT_SLO = 2.0
BATCH_DEADLINE = 20.0
CLIENT_TIMEOUT = 60.0
PROMPT = (
    "You are a helpful assistant. Summarise the following notes about KV caches, "
    "prefix reuse and scheduling in large language model serving. "
) * 4
RULES = [
    {
        "name": "batch-lane",
        "when": {"headers": {"x-lane": "batch"}},
        "then": {"class": "batch", "deadline": BATCH_DEADLINE},
    },
    {
        "name": "interactive-lane",
        "when": {"headers": {"x-lane": "interactive"}},
        "then": {"class": "interactive", "deadline": 30},
    },
]


@dataclass
class Result:
    lane: str
    intended: float
    status: int = 0
    ttft: float | None = None
    done: float | None = None
    events: int = 0
    error: str = ""


def _body(lane: str, i: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": TOKENS[lane],
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"[{i}] {PROMPT}"}],
        }
    ).encode()


async def _one(
    client: aiohttp.ClientSession, url: str, lane: str, i: int, intended: float, origin: float
) -> Result:
    result = Result(lane, intended)
    delay = origin + intended - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    try:
        async with client.post(
            url, data=_body(lane, i), headers={"content-type": "application/json", "x-lane": lane}
        ) as response:
            result.status = response.status
            if response.status != 200:
                body = await response.read()
                try:
                    result.error = str(json.loads(body)["error"]["code"])
                except (ValueError, KeyError, TypeError):
                    result.error = f"http_{response.status}"
                return result
            async for line in response.content:
                # TTFT is the first event with generated text (a role-only opening chunk,
                # should an engine send one before scheduling, does not count).
                if (
                    line.startswith(b"data:")
                    and b'"content":"' in line
                    and b'"content":""' not in line
                ):
                    if result.ttft is None:
                        result.ttft = time.perf_counter() - origin - intended
                    result.events += 1
            result.done = time.perf_counter() - origin - intended
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = type(exc).__name__
    return result


def _client() -> aiohttp.ClientSession:
    """aiohttp, not httpx: httpcore's pool costs O(connections) CPU per request and release,
    and with hundreds of requests waiting in the gateway's queue the generator itself ran out
    of CPU and sent late (the gateway's queue drained while arrivals were still due)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT, sock_connect=10.0),
    )


async def _calibrate(urls: list[str], seconds: float) -> float:
    """Closed loop at exactly the engines' batch size: requests completed per second, counted
    after a warm-up of a quarter of the run."""
    rng = random.Random(7)
    finished: list[float] = []
    start = time.perf_counter()
    stop_at = start + seconds
    async with _client() as client:

        async def worker(url: str, w: int) -> None:
            i = 0
            while time.perf_counter() < stop_at:
                lane = "interactive" if rng.random() < INTERACTIVE_SHARE else "batch"
                result = await _one(
                    client,
                    url + "/v1/chat/completions",
                    lane,
                    w * 10000 + i,
                    0.0,
                    time.perf_counter(),
                )
                i += 1
                if result.status == 200:
                    finished.append(time.perf_counter())

        await asyncio.gather(
            *(
                worker(url, n * MAX_NUM_SEQS + k)
                for n, url in enumerate(urls)
                for k in range(MAX_NUM_SEQS)
            )
        )
    warm = start + seconds / 4
    return sum(1 for t in finished if warm <= t <= stop_at) / (stop_at - warm)


async def _loop_lag(lags: list[float], stop: asyncio.Event) -> None:
    """The load generator's own event-loop lag (oversleep of 20 ms naps), in seconds: a lagging
    generator sends late and reads late, which the results would blame on the gateway."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.02)
        lags.append(loop.time() - before - 0.02)


async def _open_loop(
    url: str, rate: float, seconds: float, seed: int, lags: list[float]
) -> list[Result]:
    rng = random.Random(seed)
    arrivals: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        arrivals.append((t, "interactive" if rng.random() < INTERACTIVE_SHARE else "batch"))
    stop = asyncio.Event()
    async with _client() as client, asyncio.TaskGroup() as tasks:
        tasks.create_task(_loop_lag(lags, stop))
        origin = time.perf_counter() + 0.5
        try:
            return list(
                await asyncio.gather(
                    *(
                        _one(client, url + "/v1/chat/completions", lane, i, at, origin)
                        for i, (at, lane) in enumerate(arrivals)
                    )
                )
            )
        finally:
            stop.set()


def _yaml_config(port: int, urls: list[str], admission: bool, cap: str) -> str:
    endpoints = "\n".join(f'        - {{url: "{u}"{cap}}}' for u in urls)
    return f"""server: {{host: 127.0.0.1, port: {port}, access_log: false}}
pools:
  - name: sim
    engine: vllm
    models: [{MODEL}]
    endpoints:
{endpoints}
auth: none
classification:
  rules: {json.dumps(RULES)}
admission:
  enabled: {str(admission).lower()}
  max_queued: 4096
"""


def _fleet(
    engines: int,
) -> tuple[contextlib.AbstractContextManager[subprocess.Popen[bytes]], list[str]]:
    base = free_port()
    while True:  # engines need consecutive free ports
        if all(_port_free(base + i) for i in range(engines)):
            break
        base = free_port()
    args = [
        "-m",
        "kvgate.cli",
        "sim",
        "--engines",
        str(engines),
        "--base-port",
        str(base),
        "--profile",
        "realistic",
        "--speed",
        "1",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
    ]
    return service(args, base, "/health"), [f"http://127.0.0.1:{base + i}" for i in range(engines)]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(results: list[Result], seconds: float, capacity: float) -> dict[str, object]:
    interactive = [r for r in results if r.lane == "interactive"]
    batch = [r for r in results if r.lane == "batch"]
    ttfts = [r.ttft for r in interactive if r.status == 200 and r.ttft is not None]
    shed = Counter(r.lane for r in results if r.status == 503)
    shed_codes = Counter(r.error for r in results if r.status == 503)
    failed = Counter(
        f"{r.lane}:{r.status}:{r.error}"
        for r in results
        if r.status not in (200, 503) or (r.status == 200 and r.done is None)
    )
    good_interactive = sum(
        1
        for r in interactive
        if r.status == 200
        and r.done is not None
        and r.ttft is not None
        and r.ttft <= TTFT_SLO
        and r.events >= TOKENS["interactive"]
    )
    good_batch = sum(
        1
        for r in batch
        if r.status == 200
        and r.done is not None
        and r.done <= BATCH_DEADLINE
        and r.events >= TOKENS["batch"]
    )
    completed = sum(1 for r in results if r.status == 200 and r.done is not None)
    # Batch work an engine spent time on without it counting: finished late or cut short.
    batch_wasted = sum(
        1
        for r in batch
        if r.status == 200
        and r.done is not None
        and (r.done > BATCH_DEADLINE or r.events < TOKENS["batch"])
    )
    # Arrivals stop at `seconds`; the fleet drains after that, so divide by the whole span.
    span = max([seconds] + [r.intended + r.done for r in results if r.done is not None])
    goodput = (good_interactive + good_batch) / span
    # The same in tokens: admission completes a larger share of the short interactive requests
    # than the calibration mix has, which flatters a goodput counted in requests.
    mix_tokens = (
        INTERACTIVE_SHARE * TOKENS["interactive"] + (1 - INTERACTIVE_SHARE) * TOKENS["batch"]
    )
    good_tokens = (good_interactive * TOKENS["interactive"] + good_batch * TOKENS["batch"]) / span
    return {
        "sent": {"interactive": len(interactive), "batch": len(batch)},
        "interactive_ttft_s": {
            k: None if v is None else round(v, 3)
            for k, v in (
                ("p50", _pct(ttfts, 0.50)),
                ("p90", _pct(ttfts, 0.90)),
                ("p99", _pct(ttfts, 0.99)),
            )
        },
        "interactive_within_slo": round(good_interactive / max(1, len(interactive)), 4),
        "shed_503": dict(shed),
        "shed_codes": dict(shed_codes),
        "shed_batch_share": round(shed["batch"] / max(1, sum(shed.values())), 4),
        "other_failures": dict(failed),
        "completed": completed,
        "batch_within_deadline": good_batch,
        "batch_late_or_cut": batch_wasted,
        "span_s": round(span, 1),
        "goodput_rps": round(goodput, 2),
        "goodput_vs_capacity": round(goodput / capacity, 3),
        "goodput_tokens_vs_capacity": round(good_tokens / (capacity * mix_tokens), 3),
    }


def _classifier_cost() -> float:
    """Microseconds per classification of a typical chat request against the bench rules
    plus a keyword and a regex rule (all rules tried: none matches)."""
    rules = [
        *RULES,
        {"name": "kw", "when": {"keywords": ["translate", "tl;dr"]}, "then": {"class": "batch"}},
        {
            "name": "re",
            "when": {"regex": r"\bGDPR\b", "tools": True},
            "then": {"class": "standard"},
        },
    ]
    classifier = Classifier(ClassificationConfig.model_validate({"rules": rules}))
    tenant = build_tenant(TenantConfig(name="t", tier="gold"), DEFAULT_TIERS["gold"], None)
    payload = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": PROMPT},
        ],
    }
    headers = [
        (b"content-type", b"application/json"),
        (b"authorization", b"Bearer x"),
        (b"user-agent", b"OpenAI/Python 1.0"),
        (b"x-kvgate-workflow-id", b"wf-1"),
        (b"x-kvgate-workflow-step", b"2/5"),
    ]
    ctx = request_context("chat", payload, headers=headers)
    rounds = 20000
    start = time.perf_counter()
    for _ in range(rounds):
        classifier.classify(ctx, tenant)
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=float, default=2.5, help="multiple of capacity")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--calibrate-seconds", type=float, default=10.0)
    parser.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="write every request's result and the probe samples here (JSON)",
    )
    args = parser.parse_args()

    print(f"classifier: {_classifier_cost():.1f} us per request", flush=True)
    context, urls = _fleet(args.engines)
    with context:
        capacity = uvloop.run(_calibrate(urls, args.calibrate_seconds))
    rate = args.load * capacity
    print(
        f"capacity: {capacity:.2f} req/s; offered load: {rate:.2f} req/s "
        f"({args.load}x) for {args.duration:.0f} s",
        flush=True,
    )
    report: dict[str, object] = {"capacity_rps": round(capacity, 2), "offered_rps": round(rate, 2)}
    dump: dict[str, object] = {}
    for mode in ("admission", "none"):
        context, urls = _fleet(args.engines)
        with context as sim, tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            config = Path(tmp) / "gateway.yaml"
            config.write_text(
                _yaml_config(
                    port,
                    urls,
                    mode == "admission",
                    f", max_inflight: {MAX_NUM_SEQS}" if mode == "admission" else "",
                )
            )
            gateway_url = f"http://127.0.0.1:{port}"
            with (
                gateway(config, port) as gw,
                Sampler(
                    urls,
                    {"sim": sim.pid, "gateway": gw.pid, "loadgen": os.getpid()},
                    gateway_url if mode == "admission" else None,
                ) as sampler,
            ):
                lags: list[float] = []
                results = uvloop.run(
                    _open_loop(gateway_url, rate, args.duration, seed=11, lags=lags)
                )
        lags.sort()
        report[mode] = {
            **_summary(results, args.duration, capacity),
            "probe": {
                **sampler.summary(),
                "loadgen_lag_ms": {
                    "p50": round(1000 * (_pct(lags, 0.5) or 0), 1),
                    "p99": round(1000 * (_pct(lags, 0.99) or 0), 1),
                    "max": round(1000 * (lags[-1] if lags else 0), 1),
                },
            },
        }
        dump[mode] = {"results": [vars(r) for r in results], "samples": sampler.samples}
        print(f"{mode}: {json.dumps(report[mode])}", flush=True)
    if args.dump is not None:
        args.dump.write_text(json.dumps(dump))
    print(
        json.dumps(
            {
                "machine": {
                    "nproc": os.cpu_count(),
                    "cpu": platform.processor(),
                    "python": platform.python_version(),
                },
                **report,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
