"""`kvgate sim`: serve N simulated engines on consecutive ports until interrupted."""

import argparse
import asyncio
import signal
import sys

from .engine_server import HOST
from .faults import FAULT_MODES, Fault
from .fleet import SimFleet
from .kv_event_wire import KV_EVENT_ENCODINGS
from .options import (
    DEFAULT_KV_BLOCKS,
    DEFAULT_MODEL,
    KV_EVENTS_PORT_OFFSET,
    KV_EVENTS_REPLAY_BATCHES,
    KV_EVENTS_REPLAY_PORT_OFFSET,
    PROFILES,
    EngineOptions,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `sim` command's options on `parser`; its --help shows every default."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--engines", type=at_least_one, default=1, help="number of engines")
    parser.add_argument(
        "--host",
        default=HOST,
        help="listen address of every engine (0.0.0.0: reachable from other machines and "
        "containers)",
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=9100,
        help="engine i listens on base-port + i (0: ephemeral ports)",
    )
    parser.add_argument(
        "--flavor",
        choices=("vllm", "sglang"),
        default="vllm",
        help="engine whose API, metric names and load endpoints to imitate",
    )
    parser.add_argument(
        "--model",
        nargs="+",
        default=[DEFAULT_MODEL],
        dest="models",
        metavar="NAME",
        help="served model names",
    )
    parser.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        default="realistic",
        help="timing model: realistic (an 8B model on one H100) or fast (answers at once)",
    )
    parser.add_argument("--speed", type=float, default=1.0, help="divide all times by X")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=DEFAULT_KV_BLOCKS,
        help="KV cache blocks of 16 tokens per engine",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt plus output in tokens (None: 32768 or what the KV cache holds, "
        "if less)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences batched at once per engine"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the generated text and of fault draws"
    )
    parser.add_argument(
        "--fault",
        choices=FAULT_MODES,
        default=None,
        help="start every engine with this fault, with the mode's default parameters",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="publish KV-cache events over ZMQ as vLLM does when configured to",
    )
    parser.add_argument(
        "--kv-events-port-offset",
        type=int,
        default=KV_EVENTS_PORT_OFFSET,
        help="PUB socket on the engine's HTTP port + this",
    )
    parser.add_argument(
        "--kv-events-replay-port-offset",
        type=int,
        default=KV_EVENTS_REPLAY_PORT_OFFSET,
        help="replay (ROUTER) socket on the engine's HTTP port + this",
    )
    parser.add_argument(
        "--kv-events-encoding",
        choices=KV_EVENT_ENCODINGS,
        default="array",
        help="array: structs as arrays, tag first (older vLLM); map: maps with 'type' (newer)",
    )
    parser.add_argument(
        "--kv-events-replay-batches",
        type=int,
        default=KV_EVENTS_REPLAY_BATCHES,
        help="recent batches kept for the replay socket",
    )
    parser.add_argument(
        "--responses-store",
        action="store_true",
        help="vLLM: keep Responses API answers in each engine's memory (retrieve, cancel, "
        "background, previous_response_id), as VLLM_ENABLE_RESPONSES_API_STORE=1 does",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; print one line per engine once listening."""
    try:
        options = EngineOptions(
            flavor=args.flavor,
            models=args.models,
            profile=args.profile,
            speed=args.speed,
            kv_blocks=args.kv_blocks,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
            fault=Fault(args.fault).as_json() if args.fault else None,
            kv_events=args.kv_events,
            kv_events_port_offset=args.kv_events_port_offset,
            kv_events_replay_port_offset=args.kv_events_replay_port_offset,
            kv_events_encoding=args.kv_events_encoding,
            kv_events_replay_batches=args.kv_events_replay_batches,
            responses_store=args.responses_store,
        )
    except ValueError as error:
        print(f"kvgate sim: {error}")
        return 2
    highest = args.base_port + args.engines - 1
    if options.kv_events:
        highest += max(options.kv_events_port_offset, options.kv_events_replay_port_offset)
    if highest > 65535:
        print(
            f"kvgate sim: these engines would listen up to port {highest}, past 65535",
            file=sys.stderr,
        )
        return 2
    return asyncio.run(_serve(args.engines, args.base_port, args.host, options))


async def _serve(engines: int, base_port: int, host: str, options: EngineOptions) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with SimFleet(engines, base_port, options, host) as fleet:
            for engine in fleet.engines:
                line = f"engine {engine.index} {options.flavor} {options.models[0]} {engine.url}"
                if engine.kv_events is not None:
                    line += (
                        f" kv-events {engine.kv_events.url} replay {engine.kv_events.replay_url}"
                    )
                print(line, flush=True)
            await stop.wait()
    except OSError as error:
        print(f"kvgate sim: {error}")
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return 0


def at_least_one(text: str) -> int:
    """An argparse count of at least 1 (engines here; workers for `kvgate serve`)."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1 (got {text})")
    return count
