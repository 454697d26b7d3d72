"""Usage on every stream: the engines' own count of cached prompt tokens is what keeps the
prefix index honest (`kvgate/routing/cache_feedback.py`), and quota settlement wants real
token counts. So a stream whose client did not ask for `stream_options.include_usage` is sent
upstream asking for it, and the usage chunk (`choices: []`) is removed from what that client
receives: the client gets the events it asked for and nothing more. "Asked for" is as the
engines read it: a `stream_options` object asks for usage unless its `include_usage` is false
or null (vLLM's and SGLang's default is true). A client that turned `include_usage` off but
set `continuous_usage_stats` is left as it is: asking would put usage on every chunk.
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
        options.get("include_usage", True) is True or options.get("continuous_usage_stats")
    ):
        # Asked for: vLLM and SGLang read a `stream_options` object without `include_usage` as
        # asking. Or not to be asked for: with `continuous_usage_stats` the engine puts usage
        # on every chunk once `include_usage` is on, which the relay does not strip.
        return
    if "stream_options" in ctx.payload:  # an object without include_usage, or null
        kept = options if isinstance(options, dict) else {}
        ctx.body = orjson.dumps({**ctx.payload, "stream_options": {**kept, "include_usage": True}})
    else:
        # The body is one JSON object without the key: add it before the closing brace
        # instead of serialising the whole (possibly long) prompt again.
        ctx.body = with_member(ctx.body, _ASK)
    ctx.strip_usage = True
