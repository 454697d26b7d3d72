"""Usage on every stream: the engines' own count of cached prompt tokens is what keeps the
prefix index honest (`kvgate/routing/cache_feedback.py`), and quota settlement wants real
token counts. So a stream whose client did not ask for `stream_options.include_usage` is sent
upstream asking for it, and the usage chunk (`choices: []`) is removed from what that client
receives: the client gets the events it asked for and nothing more. Except when the client
set `stream_options.continuous_usage_stats` without `include_usage`: vLLM and SGLang then send
no usage at all, and asking for it would put usage on every chunk.
"""

from __future__ import annotations

import orjson

from kvgate.body_members import with_member
from kvgate.types import RequestContext

_ASK = b'"stream_options":{"include_usage":true}'
_ROUTES = frozenset({"chat", "completions"})


def request_usage(ctx: RequestContext) -> None:
    """Ask the engine for usage on `ctx`'s stream if its client did not; set
    `ctx.strip_usage` when the gateway asked, so the relay drops the usage chunk."""
    if not ctx.stream or ctx.route not in _ROUTES:
        return
    options = ctx.payload.get("stream_options")
    if isinstance(options, dict) and (
        options.get("include_usage") is True or options.get("continuous_usage_stats")
    ):
        # Asked for, or not to be asked for: with `continuous_usage_stats` (vLLM, SGLang) the
        # engine puts usage on every chunk once `include_usage` is on, which the relay does
        # not strip; such a stream's usage is estimated.
        return
    if "stream_options" in ctx.payload:  # an object without include_usage, or null
        kept = options if isinstance(options, dict) else {}
        ctx.body = orjson.dumps({**ctx.payload, "stream_options": {**kept, "include_usage": True}})
    else:
        # The body is one JSON object without the key: add it before the closing brace
        # instead of serialising the whole (possibly long) prompt again.
        ctx.body = with_member(ctx.body, _ASK)
    ctx.strip_usage = True
