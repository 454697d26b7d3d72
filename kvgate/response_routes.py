"""The routes under `/v1/responses/{response_id}`, and their names in metrics, logs and traces.

vLLM serves `GET /v1/responses/{id}` (retrieve; with `?stream=true&starting_after=N` it
replays a background response's events as a stream) and `POST /v1/responses/{id}/cancel`.
kvgate forwards those and any other method or subpath under the id as it came, query string
included, and lets the engine answer: `responses_retrieve`, `responses_cancel`, and
`responses_other` for the rest. HEAD is refused (405): its answer has no body, which the
upstream client cannot frame. So is a subpath that could leave the id's routes once a hop
normalises it (`/../../reset_prefix_cache` arrives with the gateway's engine key): a `.` or
`..` segment, in the path or percent-encoded, or an encoded `/` (404 `unknown_url`).
"""

from __future__ import annotations

from urllib.parse import parse_qs, quote, unquote

from kvgate.errors import NotFound

PREFIX = "/v1/responses/"
RETRIEVE = "responses_retrieve"
CANCEL = "responses_cancel"
OTHER = "responses_other"
ROUTES = frozenset({RETRIEVE, CANCEL, OTHER})
# What a trace names a request by (`http.route`): the route, never a response id.
TEMPLATES = {
    RETRIEVE: PREFIX + "{response_id}",
    CANCEL: PREFIX + "{response_id}/cancel",
    OTHER: PREFIX + "{response_id}/*",
}
METHODS = ("GET", "POST", "DELETE", "PUT", "PATCH")
# FastAPI's true for a boolean query parameter, as vLLM reads `stream`.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})


def split(path: str) -> tuple[str, str] | None:
    """The response id a path under `/v1/responses/` names and the rest of the path ('' or,
    e.g., '/cancel'); None for any other path."""
    if not path.startswith(PREFIX):
        return None
    response_id, slash, rest = path[len(PREFIX) :].partition("/")
    if not response_id:
        return None
    return response_id, slash + rest


def check_subpath(rest: str, raw_path: bytes | None) -> None:
    """Refuse (NotFound) a subpath after the id with a `.` or `..` segment, or a `/` the
    client encoded (`raw_path`: the path as sent, when the server gives it)."""
    segments = rest.split("/")[1:]
    encoded_slash = raw_path is not None and b"%2f" in raw_path.lower()
    if encoded_slash or any(unquote(s) in (".", "..") for s in segments):
        raise NotFound(
            f"Unknown route {PREFIX}{{response_id}}{rest}: no '.' or '..' segment or encoded "
            "'/' may follow a response id",
            code="unknown_url",
        )


def route_of(method: str, rest: str) -> str:
    if rest == "" and method == "GET":
        return RETRIEVE
    if rest == "/cancel" and method == "POST":
        return CANCEL
    return OTHER


def wants_stream(route: str, query: bytes) -> bool:
    """Whether the engine will answer with a stream: a retrieve whose query says
    `stream=true` (the last value given, as FastAPI reads it)."""
    if route != RETRIEVE or b"stream" not in query:
        return False
    values = parse_qs(query.decode("latin-1")).get("stream")
    return values is not None and values[-1].lower() in _TRUE


def upstream_path(response_id: str, rest: str, query: bytes) -> str:
    """The path and query to send upstream for `response_id` (percent-encoded again: ASGI
    hands the path decoded)."""
    path = PREFIX + quote(response_id, safe="") + quote(rest, safe="/")
    return path + "?" + query.decode("latin-1") if query else path


def with_response_id(path: str, named: str, response_id: str) -> str:
    """`path` (made by `upstream_path` for `named`) for `response_id` instead."""
    return PREFIX + quote(response_id, safe="") + path[len(PREFIX) + len(quote(named, safe="")) :]
