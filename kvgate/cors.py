"""Cross-origin requests from browsers (CORS), when `server.cors` allows them.

A page served from another origin (a chat UI at https://chat.example.com calling the gateway
with the OpenAI SDK) may read the gateway's answers only if the gateway says so. Off by default:
a gateway without `auth:` listens on loopback, and any web page a user opens could otherwise use
it. vLLM and SGLang allow every origin unless told otherwise; here the operator names them.

Starlette's middleware does the protocol: a preflight (`OPTIONS` with
`Access-Control-Request-Method`) is answered here, 200 or 400 naming what is not allowed, and
reaches neither the chain nor an engine; every other answer to an allowed origin carries
`Access-Control-Allow-Origin` and exposes the gateway's own headers to the page's script.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware

from kvgate.asgi import ASGIApp
from kvgate.config import CorsConfig

# The methods of the gateway's routes: POST (inference, admin actions, a stored response's
# cancel), GET (models, health, metrics, admin reads, a stored response) and DELETE (OpenAI's
# for a stored response, forwarded to the engine that holds it).
METHODS = ("GET", "POST", "DELETE")
# Response headers a page's script may read beyond the safelisted ones (content-type, ...).
EXPOSED_HEADERS = ("x-request-id", "x-kvgate-endpoint", "x-kvgate-route-explain", "retry-after")


def with_cors(serve: ASGIApp, config: CorsConfig) -> ASGIApp:
    """`serve` behind the CORS protocol `config` describes."""
    return CORSMiddleware(
        serve,
        allow_origins=config.allow_origins,
        allow_methods=METHODS,
        allow_headers=config.allow_headers,
        expose_headers=EXPOSED_HEADERS,
        max_age=config.max_age,
    )
