"""The `classify` stage: rules from config turn a request into an `Intent`.

Rules are tried in order; the first whose conditions all hold sets the latency class, deadline
and residency, and its name is recorded in the intent (that is the explanation). No rule: the
tier's default class and the class's deadline. A tier's `best_class` caps what any rule grants.
Everything is compiled at config load: fnmatch patterns and keywords become regexes, header
names are lower-cased bytes. Per request the work is a few dict lookups and, only when a rule
needs them, one pass over the prompt text. Deterministic: same request, same intent.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Any

from kvgate.chain.intent import CLASS_RANK, Intent, Workflow, request_priority
from kvgate.chain.settings import (
    DEFAULT_CLASSES,
    ClassConfig,
    ClassificationConfig,
    LatencyClass,
    RuleConfig,
)
from kvgate.chain.tenants import Tenant
from kvgate.errors import InvalidRequest
from kvgate.types import Headers, RequestContext, header_value

WORKFLOW_ID_HEADER = b"x-kvgate-workflow-id"
WORKFLOW_STEP_HEADER = b"x-kvgate-workflow-step"
DEADLINE_HEADER = b"x-kvgate-deadline"
_WORKFLOW_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")
_STEP = re.compile(rb"\s*(\d{1,6})\s*(?:/\s*(\d{1,6})\s*)?")


class _Request:
    """Lazily computed views of one request that rules may look at."""

    __slots__ = ("_text", "ctx", "prompt_tokens", "texts")

    def __init__(self, ctx: RequestContext, texts: list[str], prompt_tokens: int) -> None:
        self.ctx = ctx
        self.texts = texts
        self.prompt_tokens = prompt_tokens
        self._text: str | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "\n".join(self.texts)
        return self._text

    def header(self, name: bytes) -> bytes | None:
        return header_value(self.ctx.client_headers, name)


@dataclass(frozen=True, slots=True)
class _Rule:
    name: str
    model: re.Pattern[str] | None
    routes: frozenset[str] | None
    stream: bool | None
    tools: bool | None
    headers: tuple[tuple[bytes, bytes], ...]
    min_prompt: int | None
    max_prompt: int | None
    text: tuple[re.Pattern[str], ...]
    latency_class: LatencyClass | None
    deadline: float | None
    residency: frozenset[str] | None

    def matches(self, request: _Request) -> bool:
        ctx = request.ctx
        if self.model is not None and self.model.fullmatch(ctx.model) is None:
            return False
        if self.routes is not None and ctx.route not in self.routes:
            return False
        if self.stream is not None and ctx.stream != self.stream:
            return False
        if self.tools is not None and bool(ctx.payload.get("tools")) != self.tools:
            return False
        if self.min_prompt is not None and request.prompt_tokens < self.min_prompt:
            return False
        if self.max_prompt is not None and request.prompt_tokens >= self.max_prompt:
            return False
        for name, value in self.headers:
            if request.header(name) != value:
                return False
        return all(pattern.search(request.text) for pattern in self.text)


def _compile(rule: RuleConfig) -> _Rule:
    when, then = rule.when, rule.then
    model = None
    if when.model is not None:
        model = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in when.model))
    text: list[re.Pattern[str]] = []
    if when.keywords:
        text.append(re.compile("|".join(re.escape(k) for k in when.keywords), re.IGNORECASE))
    if when.regex is not None:
        text.append(re.compile(when.regex))
    return _Rule(
        name=rule.name,
        model=model,
        routes=frozenset(when.route) if when.route is not None else None,
        stream=when.stream,
        tools=when.tools,
        headers=tuple(
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in (when.headers or {}).items()
        ),
        min_prompt=when.prompt_tokens_at_least,
        max_prompt=when.prompt_tokens_below,
        text=tuple(text),
        latency_class=then.latency_class,
        deadline=then.deadline,
        residency=frozenset(then.residency) if then.residency is not None else None,
    )


def _texts(route: str, payload: dict[str, Any]) -> list[str]:
    """The prompt's text pieces (chat message contents, completion prompts, embedding input)."""
    if route == "chat":
        out: list[str] = []
        for message in payload["messages"]:
            content = message.get("content")
            if isinstance(content, str):
                out.append(content)
            elif isinstance(content, list):
                out.extend(
                    part["text"]
                    for part in content
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
        return out
    carrier = payload["prompt" if route == "completions" else "input"]
    if isinstance(carrier, str):
        return [carrier]
    return [p for p in carrier if isinstance(p, str)]


def _token_ids(route: str, payload: dict[str, Any]) -> int:
    """Prompt tokens given directly as token ids (completions and embeddings only)."""
    if route == "chat":
        return 0
    carrier = payload["prompt" if route == "completions" else "input"]
    if isinstance(carrier, list) and carrier and not isinstance(carrier[0], str):
        return sum(len(p) if isinstance(p, list) else 1 for p in carrier)
    return 0


def _workflow(headers: Headers) -> Workflow | None:
    raw_id = header_value(headers, WORKFLOW_ID_HEADER)
    raw_step = header_value(headers, WORKFLOW_STEP_HEADER)
    if raw_id is None and raw_step is None:
        return None
    if raw_id is None or not _WORKFLOW_ID.fullmatch(raw_id):
        raise InvalidRequest(
            "x-kvgate-workflow-id must be 1-128 characters of "
            "A-Z a-z 0-9 . _ : - when a workflow step is given",
            param="x-kvgate-workflow-id",
            code="invalid_header",
        )
    step, total = 1, None
    if raw_step is not None:
        match = _STEP.fullmatch(raw_step)
        if (
            match is None
            or int(match.group(1)) < 1
            or (match.group(2) is not None and int(match.group(2)) < int(match.group(1)))
        ):
            raise InvalidRequest(
                "x-kvgate-workflow-step must be 'N' or 'N/TOTAL' with 1 <= N <= TOTAL",
                param="x-kvgate-workflow-step",
                code="invalid_header",
            )
        step = int(match.group(1))
        total = int(match.group(2)) if match.group(2) is not None else None
    return Workflow(raw_id.decode(), step, total)


def _client_deadline(headers: Headers) -> float | None:
    raw = header_value(headers, DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < 1e7):
        raise InvalidRequest(
            "x-kvgate-deadline must be a positive number of seconds",
            param="x-kvgate-deadline",
            code="invalid_header",
        )
    return seconds


class Classifier:
    """Pure: `classify(ctx, tenant)` depends only on the request, the tenant and config."""

    def __init__(self, config: ClassificationConfig) -> None:
        self.rules = tuple(_compile(r) for r in config.rules)
        self.classes: dict[str, ClassConfig] = {**DEFAULT_CLASSES, **config.classes}
        self.default_max_tokens = config.default_max_tokens
        self.chars_per_token = config.chars_per_token

    def estimate_prompt_tokens(self, ctx: RequestContext, texts: list[str]) -> int:
        """Prompt tokens from the text pieces `_texts` found, plus any given as token ids."""
        chars = sum(len(t) for t in texts)
        return math.ceil(chars / self.chars_per_token) + _token_ids(ctx.route, ctx.payload)

    def requested_output_tokens(self, ctx: RequestContext) -> int:
        if ctx.route == "embeddings":
            return 0
        payload = ctx.payload
        limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
        if limit is None:
            limit = self.default_max_tokens
        n = payload.get("n")
        return int(limit) * (n if isinstance(n, int) and n > 1 else 1)

    def classify(self, ctx: RequestContext, tenant: Tenant) -> Intent:
        texts = _texts(ctx.route, ctx.payload)  # once: for the estimate and any text rule
        request = _Request(ctx, texts, self.estimate_prompt_tokens(ctx, texts))
        rule = next((r for r in self.rules if r.matches(request)), None)
        latency_class: LatencyClass = tenant.default_class
        if rule is not None and rule.latency_class is not None:
            latency_class = rule.latency_class
        capped = CLASS_RANK[latency_class] < CLASS_RANK[tenant.best_class]
        if capped:
            latency_class = tenant.best_class
        deadline = self.classes[latency_class].deadline
        if rule is not None and rule.deadline is not None:
            deadline = rule.deadline
        client_deadline = _client_deadline(ctx.client_headers)
        if client_deadline is not None:
            deadline = min(deadline, client_deadline)
        residency = tenant.residency
        if rule is not None and rule.residency is not None:
            residency = rule.residency if residency is None else residency & rule.residency
        return Intent(
            model=ctx.model,
            latency_class=latency_class,
            prompt_tokens=request.prompt_tokens,
            max_tokens=self.requested_output_tokens(ctx),
            tier=tenant.tier,
            deadline=deadline,
            workflow=_workflow(ctx.client_headers),
            residency=residency,
            rule=rule.name if rule is not None else None,
            capped=capped,
        )

    def max_queue_wait(self, latency_class: LatencyClass) -> float | None:
        return self.classes[latency_class].max_queue_wait


class ClassifyStage:
    """Sets `ctx.intent`, `ctx.tier`, `ctx.priority`, `ctx.deadline` and
    `ctx.allowed_jurisdictions` from the authenticated tenant (never from client headers)."""

    def __init__(self, classifier: Classifier) -> None:
        self.classifier = classifier

    async def __call__(self, ctx: RequestContext) -> None:
        tenant = ctx.tenant
        assert tenant is not None, "the auth stage runs first"
        intent = self.classifier.classify(ctx, tenant)
        ctx.intent = intent
        ctx.tier = tenant.tier
        ctx.priority = request_priority(intent.latency_class, tenant.tier_priority)
        ctx.deadline = ctx.started + intent.deadline
        ctx.allowed_jurisdictions = intent.residency
