"""`kvgate serve | demo | sim | check-config` — the one command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging.config
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import uvicorn

from kvgate import __version__
from kvgate.config import Config, ConfigError, load_config, server_in_effect
from kvgate.demo import run_demo
from kvgate.http_server import use_header_limits
from kvgate.observability.log_format import LOG_FORMATS, logging_config
from kvgate.observability.tracing import check_tracing_settings
from kvgate.routing.policy import RoutingPolicy
from kvgate.routing.policy_catalog import BUILTIN, load_policies, shipped_names, shipped_text
from kvgate.routing.prompt_tokens import load_tokenizers
from kvgate.serving import uvicorn_options
from kvgate.sim.cli import at_least_one
from kvgate.worker_supervisor import serve_workers

if TYPE_CHECKING:
    from kvgate.hot_reload import ReloadableGateway


def _port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535, as `server.port` in the config."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (an integer from 0 to 65535)")
    return port


def _loaded(path: Path) -> tuple[Config, dict[str, RoutingPolicy]] | None:
    """The config file and its pools' routing policies, or None after printing every problem
    (config and policies alike)."""
    try:
        config = load_config(path)
        policies = load_policies(config)
        load_tokenizers(config)  # a pool's tokenizer directory must load
        check_tracing_settings(config.observability.tracing)  # and the OTEL_* variables
        return config, policies
    except ConfigError as exc:
        problems = exc.problems
        if exc.parsed is not None:  # every key was valid: its policy files can be checked too
            try:
                load_policies(exc.parsed)
            except ConfigError as policy_errors:
                problems = [*problems, *policy_errors.problems]
        _print_problems(ConfigError(exc.source, problems))
        return None


def _print_problems(exc: ConfigError) -> None:
    for problem in exc.problems:
        print(f"{exc.source}: {problem}", file=sys.stderr)
    print(f"{exc.source}: {len(exc.problems)} problem(s)", file=sys.stderr)


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvgate.hot_reload import CONFIG_ENV, SERVER_IN_EFFECT_ENV, ReloadableGateway
    from kvgate.observability.metrics import MULTIPROCESS_DIR

    loaded = _loaded(args.config)
    if loaded is None:
        return 1
    config, _ = loaded
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    if config.server.admin_port == port != 0:
        print(f"kvgate serve: port {port} is server.admin_port too", file=sys.stderr)
        return 1
    from_file = server_in_effect(config)
    started = {"file": from_file, "in_effect": {**from_file, "host": host, "port": port}}
    logging.config.dictConfig(logging_config(args.log_level, args.log_format))
    options = uvicorn_options(
        host,
        port,
        args.log_level,
        args.log_format,
        keepalive=config.server.keepalive_timeout,
        drain_seconds=config.server.drain_seconds,
    )
    if args.workers > 1:
        if config.server.admin_port is not None:
            print(
                "kvgate serve: server.admin_port needs one worker (each worker would need a "
                "port of its own); run one worker, or drop admin_port and firewall /metrics "
                "and /admin/* at the proxy in front",
                file=sys.stderr,
            )
            return 1
        if config.state.backend == "memory":
            print(
                f"kvgate serve: --workers {args.workers} needs shared state: with "
                "'state: {backend: memory}' every worker would keep its own prefix index, "
                "load counts and quotas, silently splitting them. Configure "
                "'state: {backend: redis, url: redis://...}' (docs/redis.md) or run one "
                "worker.",
                file=sys.stderr,
            )
            return 1
        os.environ[CONFIG_ENV] = str(Path(args.config).resolve())
        os.environ[SERVER_IN_EFFECT_ENV] = orjson.dumps(started).decode()
        # The workers keep their metric values in files here and every scrape sums them; a
        # fresh directory per run, so a restarted gateway starts its counters from zero.
        with tempfile.TemporaryDirectory(prefix="kvgate-metrics-") as metrics_dir:
            os.environ[MULTIPROCESS_DIR] = metrics_dir
            serve_workers(
                uvicorn.Config(
                    "kvgate.hot_reload:app_from_env",
                    factory=True,
                    workers=args.workers,
                    **options,
                )
            )
        return 0
    try:
        app = ReloadableGateway(args.config, started=started)
    except ConfigError as exc:  # the OTEL_* variables are read only when the app is built
        _print_problems(exc)
        return 1
    use_header_limits(config.server.header_timeout, config.server.max_header_bytes)
    public = uvicorn.Server(uvicorn.Config(app, **options))
    if config.server.admin_port is None:
        public.run()
        return 0
    admin_port = config.server.admin_port
    admin = uvicorn.Server(
        admin_listener_config(app, host, admin_port, args.log_level, args.log_format)
    )
    with asyncio.Runner(loop_factory=public.config.get_loop_factory()) as runner:
        runner.run(serve_with_admin(public, admin))
    return 0


def admin_listener_config(
    app: ReloadableGateway, host: str, port: int, log_level: str, log_format: str
) -> uvicorn.Config:
    """The admin port's server: `AdminListener` over the gateway's admin routes (reload
    included) and metrics, no lifespan (the public server runs the gateway's)."""
    from kvgate.admin_listener import AdminListener

    options = {**uvicorn_options(host, port, log_level, log_format), "lifespan": "off"}
    return uvicorn.Config(AdminListener(app.admin_routes, app.render_metrics), **options)


async def serve_with_admin(public: uvicorn.Server, admin: uvicorn.Server) -> None:
    """Both listeners on one event loop. The admin server starts first, so the public one
    installs its signal handlers last and gets Ctrl+C / SIGTERM; the admin one stops with it."""
    admin_task = asyncio.create_task(admin.serve())
    await asyncio.sleep(0)  # let the admin server install its signal handlers first
    try:
        await public.serve()
    finally:
        admin.should_exit = True
        await admin_task


def _cmd_check_config(args: argparse.Namespace) -> int:
    loaded = _loaded(args.file)
    if loaded is None:
        return 1
    config, _ = loaded
    endpoints = sum(len(p.endpoints) for p in config.pools)
    print(f"{args.file}: OK ({len(config.pools)} pool(s), {endpoints} endpoint(s))")
    return 0


def _cmd_keys_new(args: argparse.Namespace) -> int:
    from kvgate.chain.keys import new_key, new_key_id

    if args.tenant is not None and not args.tenant.strip():
        print("kvgate keys new: --tenant needs the tenant's name", file=sys.stderr)
        return 1
    try:
        key, digest = new_key(args.id or new_key_id(args.tenant or "admin"))
    except ValueError as exc:
        print(f"kvgate keys new: {exc}", file=sys.stderr)
        return 1
    where = "auth.admin_keys" if args.admin else f"the keys of tenant '{args.tenant}'"
    key_id = key.partition(".")[0]
    print(
        f"API key (shown once; kvgate stores only its hash):\n\n    {key}\n\n"
        f"Add this line to {where} in the config:\n\n"
        f'    - {{id: {key_id}, sha256: "{digest}"}}'
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    logging.config.dictConfig(logging_config(args.log_level, args.log_format))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_demo(args.host, args.port, args.log_level, args.log_format))
    return 0


def _cmd_policies(args: argparse.Namespace) -> int:
    if args.policies_command == "list":
        for name in BUILTIN:
            print(f"{name}\tbuilt in")
        for name in shipped_names():
            print(f"{name}\tshipped (kvgate policies show {name})")
        return 0
    text = shipped_text(args.name)
    if text is None:
        known = ", ".join(shipped_names())
        print(
            f"kvgate policies show: no shipped policy '{args.name}' (one of: {known}; "
            f"{', '.join(BUILTIN)} are built into the code)",
            file=sys.stderr,
        )
        return 1
    print(text, end="")
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from kvgate.sim import cli as sim_cli

    return sim_cli.run(args)


# Loopback by default: a gateway without an `auth:` section is open, and binding every interface
# must be a choice (the container image makes it, with KVGATE_HOST=0.0.0.0).
DEFAULT_HOST = "127.0.0.1"
_BIND_NOTE = (
    f"Listens on {DEFAULT_HOST} unless told otherwise, so a gateway without auth is not "
    "reachable from other machines by accident; use --host 0.0.0.0 (or KVGATE_HOST) to serve "
    "the network."
)
LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(value: str) -> str:
    level = value.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid log level '{value}' (one of: {', '.join(LOG_LEVELS)})"
        )
    return level


def _add_log_options(parser: argparse.ArgumentParser, log_format: str) -> None:
    # A `type`, not `choices`: argparse checks a default taken from the environment only
    # through its type.
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=os.environ.get("KVGATE_LOG_LEVEL") or "info",
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="log level (default: $KVGATE_LOG_LEVEL, else info)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=log_format,
        help=f"one JSON object per line, or plain text (default: {log_format})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description=("KV/prefix-aware OpenAI-compatible gateway for vLLM and SGLang fleets."),
    )
    parser.add_argument("--version", action="version", version=f"kvgate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the gateway from a config file",
        description=f"Run the gateway from a config file. {_BIND_NOTE}",
    )
    serve.add_argument(
        "--config",
        type=Path,
        default=os.environ.get("KVGATE_CONFIG") or None,
        help="YAML config file (default: $KVGATE_CONFIG; one of them is needed)",
    )
    serve.add_argument(
        "--host",
        default=os.environ.get("KVGATE_HOST") or None,
        help=f"listen address (default: $KVGATE_HOST, else server.host from config, "
        f"else {DEFAULT_HOST})",
    )
    serve.add_argument(
        "--port",
        type=_port,
        default=os.environ.get("KVGATE_PORT") or None,
        help="listen port (default: $KVGATE_PORT, else server.port from config)",
    )
    serve.add_argument(
        "--workers",
        type=at_least_one,
        default=1,
        help="worker processes, each a full replica (needs state.backend redis)",
    )
    _add_log_options(serve, "json")
    serve.set_defaults(func=_cmd_serve)

    demo = commands.add_parser(
        "demo",
        help="run the gateway over an embedded simulated fleet, in-memory state",
        description="Run the gateway over two embedded simulated vLLM engines, in-memory "
        f"state, no auth. {_BIND_NOTE}",
    )
    demo.add_argument(
        "--host",
        default=os.environ.get("KVGATE_HOST") or DEFAULT_HOST,
        help=f"listen address (default: $KVGATE_HOST, else {DEFAULT_HOST})",
    )
    demo.add_argument(
        "--port",
        type=_port,
        default=os.environ.get("KVGATE_PORT") or "8080",
        help="listen port (default: $KVGATE_PORT, else 8080)",
    )
    _add_log_options(demo, "text")
    demo.set_defaults(func=_cmd_demo)

    keys = commands.add_parser("keys", help="manage API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    new = key_commands.add_parser(
        "new", help="print a fresh API key once, and the config line holding its hash"
    )
    owner = new.add_mutually_exclusive_group(required=True)
    owner.add_argument("--tenant", help="tenant the key belongs to")
    owner.add_argument("--admin", action="store_true", help="an admin key (admin routes)")
    new.add_argument("--id", help="key id (default: tenant name and 6 random hex digits)")
    new.set_defaults(func=_cmd_keys_new)

    policies = commands.add_parser("policies", help="list or print the shipped routing policies")
    policy_commands = policies.add_subparsers(
        dest="policies_command", required=True, metavar="COMMAND"
    )
    policy_commands.add_parser("list", help="every name `policy:` accepts without a path")
    show = policy_commands.add_parser("show", help="print a shipped policy's YAML to copy")
    show.add_argument("name")
    policies.set_defaults(func=_cmd_policies)

    check = commands.add_parser("check-config", help="validate a config file and list problems")
    check.add_argument("file", type=Path)
    check.set_defaults(func=_cmd_check_config)

    sim = commands.add_parser("sim", help="serve simulated vLLM/SGLang engines")
    from kvgate.sim import cli as sim_cli

    sim_cli.add_arguments(sim)
    sim.set_defaults(func=_cmd_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.config is None:
        parser.error("serve needs a config file: --config FILE, or set KVGATE_CONFIG")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
