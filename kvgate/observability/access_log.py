"""One structured line per request: ids, route, model, endpoint, status, timings, tokens.

The message is the record as JSON (the text format prints it); the JSON format puts the
record's fields at the top level of the line (`kvgate.observability.log_format`).

Never prompts, bodies or credentials: only what is needed to trace and account a request.
"""

from __future__ import annotations

import logging
import time

import orjson

from kvgate.errors import KvgateError
from kvgate.observability.log_format import FIELDS
from kvgate.types import RequestContext

log = logging.getLogger("kvgate.access")


class AccessLog:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def finished(self, ctx: RequestContext, cost: float | None = None) -> None:
        """Log `ctx`; `cost` is its dollars when its pool has a price."""
        if not self.enabled or not log.isEnabledFor(logging.INFO):
            return
        record = {
            "request_id": ctx.request_id,
            "route": ctx.route,
            "model": ctx.model,
            "stream": ctx.stream,
            "tenant": ctx.tenant.name if ctx.tenant else None,
            "key_id": ctx.key_id,
            "endpoint": ctx.endpoint.name if ctx.endpoint else None,
            "attempts": ctx.attempts,
            "status": ctx.status,
            "outcome": ctx.outcome,
            "duration_ms": round((time.perf_counter() - ctx.started) * 1000, 3),
        }
        if ctx.first_token_at is not None:
            record["ttft_ms"] = round((ctx.first_token_at - ctx.started) * 1000, 3)
        if ctx.resumes:
            record["resumes"] = ctx.resumes
            record["resume_overhead_tokens"] = ctx.resume_overhead_tokens
        if ctx.usage is not None:
            usage = {
                k: v for k, v in ctx.usage.items() if k in ("prompt_tokens", "completion_tokens")
            }
            details = ctx.usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                usage["cached_tokens"] = details["cached_tokens"]
            record["usage"] = usage
        if cost is not None:
            record["cost_dollars"] = cost
        log.info(orjson.dumps(record).decode(), extra={FIELDS: record})

    def rejected(
        self, request_id: str, route: str, error: KvgateError, key_id: str | None = None
    ) -> None:
        """A request refused at ingress; `key_id`: a revoked key's (a rotation is when an
        operator reads these lines)."""
        if not self.enabled or not log.isEnabledFor(logging.INFO):
            return
        record = {
            "request_id": request_id,
            "route": route,
            "status": error.status,
            "outcome": error.outcome,
        }
        if key_id is not None:
            record["key_id"] = key_id
        log.info(orjson.dumps(record).decode(), extra={FIELDS: record})
