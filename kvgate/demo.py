"""`kvgate demo`: the gateway over an embedded simulated fleet, in-memory state, one command."""

from __future__ import annotations

import socket

import uvicorn

from kvgate.config import Config, parse_config
from kvgate.serving import uvicorn_options

DEMO_MODEL = "sim-model"
DEMO_ENGINES = 2


def demo_config(urls: list[str], port: int) -> Config:
    """The embedded demo: one vLLM-flavoured pool over the simulated engines, memory state."""
    return parse_config(
        {
            "server": {"host": "127.0.0.1", "port": port},
            "pools": [
                {
                    "name": "demo",
                    "engine": "vllm",
                    "models": [DEMO_MODEL],
                    "endpoints": [{"url": u} for u in urls],
                }
            ],
            "state": {"backend": "memory"},
            "auth": "none",
        },
        source="<demo>",
    )


_SNIPPET = """\
kvgate demo: gateway on {base} over {n} simulated vLLM engines (in-memory state)

    from openai import OpenAI
    client = OpenAI(base_url="{base}", api_key="unused")
    stream = client.chat.completions.create(
        model="{model}", stream=True,
        messages=[{{"role": "user", "content": "Tell me about KV caches."}}])
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="", flush=True)

    curl {base}/chat/completions -H 'content-type: application/json' \\
      -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]}}'

Press Ctrl+C to stop."""


async def run_demo(host: str, port: int, log_level: str, log_format: str) -> None:
    from kvgate.app import GatewayApp
    from kvgate.sim import EngineOptions, SimFleet

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise SystemExit(
            f"kvgate demo: cannot listen on {host}:{port}: {exc.strerror}; "
            "choose another with --port"
        ) from None
    bound = listener.getsockname()[1]
    options = EngineOptions(flavor="vllm", models=[DEMO_MODEL], profile="realistic")
    async with SimFleet(engines=DEMO_ENGINES, base_port=0, options=options) as fleet:
        config = demo_config(list(fleet.urls), bound)
        app = GatewayApp(config)
        server_options = uvicorn_options(
            host, bound, log_level, log_format, keepalive=config.server.keepalive_timeout
        )
        server = uvicorn.Server(uvicorn.Config(app, **server_options))
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(
            _SNIPPET.format(base=f"http://{shown}:{bound}/v1", n=DEMO_ENGINES, model=DEMO_MODEL),
            flush=True,
        )
        await server.serve(sockets=[listener])
