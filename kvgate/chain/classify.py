"""The `classify` stage: rules from config turn a request into an `Intent`.

Rules are tried in order. The first whose conditions all hold, among those that set more than
residency, sets the latency class and deadline (its name is the intent's `rule`: that is the
explanation); no such rule: the tier's default class and the class's deadline. Residency is a
constraint, not a choice: every matching rule that sets one narrows the request's residency
(the intersection with the tenant's and the other rules'), so a class rule earlier in the list
never shadows a residency rule (the intent lists them in `residency_rules`). A tier's
`best_class` caps what any rule grants.
Everything is compiled at config load: fnmatch patterns and keywords become regexes, header
names are lower-cased bytes. Per request the work is a few dict lookups and, only when a rule
needs them, one pass over the prompt text. Deterministic: same request, same intent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvgate.chain.intent import CLASS_RANK, Intent, request_priority
from kvgate.chain.settings import (
    DEFAULT_CLASSES,
    ClassConfig,
    ClassificationConfig,
    LatencyClass,
    RuleConfig,
)
from kvgate.chain.tenants import Tenant
from kvgate.globs import compile_globs
from kvgate.ingress import GENERATION_ROUTES
from kvgate.types import RequestContext, header_value


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

    def matches(self, ctx: RequestContext) -> bool:
        if self.model is not None and self.model.fullmatch(ctx.model) is None:
            return False
        if self.routes is not None and ctx.route not in self.routes:
            return False
        if self.stream is not None and ctx.stream != self.stream:
            return False
        if self.tools is not None and bool(ctx.payload.get("tools")) != self.tools:
            return False
        if self.min_prompt is not None and ctx.view.prompt_tokens < self.min_prompt:
            return False
        if self.max_prompt is not None and ctx.view.prompt_tokens >= self.max_prompt:
            return False
        for name, value in self.headers:
            if header_value(ctx.client_headers, name) != value:
                return False
        return all(pattern.search(ctx.view.text) for pattern in self.text)


def _compile(rule: RuleConfig) -> _Rule:
    when, then = rule.when, rule.then
    model = compile_globs(when.model) if when.model is not None else None
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


class Classifier:
    """Pure: `classify(ctx, tenant)` depends only on the request, the tenant and config."""

    def __init__(self, config: ClassificationConfig) -> None:
        self.rules = tuple(_compile(r) for r in config.rules)
        # A rule that only sets residency takes no part in choosing the class.
        self.class_rules = tuple(
            r
            for r in self.rules
            if r.latency_class is not None or r.deadline is not None or r.residency is None
        )
        self.residency_rules = tuple(r for r in self.rules if r.residency is not None)
        self.classes: dict[LatencyClass, ClassConfig] = {**DEFAULT_CLASSES, **config.classes}
        self.default_max_tokens = config.default_max_tokens

    def requested_output_tokens(self, ctx: RequestContext) -> int:
        if ctx.route not in GENERATION_ROUTES:
            return 0
        payload = ctx.payload
        limit = payload.get(output_limit_field(ctx))
        if limit is None:
            limit = self.default_max_tokens
        n = payload.get("n")
        choices = int(n) if isinstance(n, int | float) and n > 1 else 1  # ingress checked it
        return int(limit) * choices * _prompts(ctx)

    def classify(self, ctx: RequestContext, tenant: Tenant) -> Intent:
        rule = next((r for r in self.class_rules if r.matches(ctx)), None)
        latency_class: LatencyClass = tenant.default_class
        if rule is not None and rule.latency_class is not None:
            latency_class = rule.latency_class
        capped = CLASS_RANK[latency_class] < CLASS_RANK[tenant.best_class]
        if capped:
            latency_class = tenant.best_class
        deadline = self.classes[latency_class].deadline
        if rule is not None and rule.deadline is not None:
            deadline = rule.deadline
        client_deadline = ctx.options.deadline
        if client_deadline is not None:
            deadline = min(deadline, client_deadline)
        residency = tenant.residency
        residency_rules = tuple(r for r in self.residency_rules if r.matches(ctx))
        for matched in residency_rules:
            assert matched.residency is not None
            residency = matched.residency if residency is None else residency & matched.residency
        return Intent(
            model=ctx.model,
            latency_class=latency_class,
            prompt_tokens=ctx.view.prompt_tokens,
            max_tokens=self.requested_output_tokens(ctx),
            tier=tenant.tier,
            deadline=deadline,
            workflow=ctx.options.workflow,
            residency=residency,
            rule=rule.name if rule is not None else None,
            residency_rules=tuple(r.name for r in residency_rules),
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


def output_limit_field(ctx: RequestContext) -> str:
    """The body field that limits the request's completion tokens, as the engines read it:
    `max_output_tokens` for the Responses API; for chat `max_completion_tokens` when given
    (OpenAI's newer name, which vLLM prefers too), else `max_tokens`; for completions
    `max_tokens` (their request has no `max_completion_tokens`: an engine ignores it)."""
    if ctx.route == "responses":
        return "max_output_tokens"
    if ctx.route == "chat" and ctx.payload.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def _prompts(ctx: RequestContext) -> int:
    """The prompts a request generates for: a completions `prompt` that is a list of strings or
    of token-id lists is a batch, each prompt generating up to the limit (vLLM and SGLang);
    anything else is one."""
    prompt = ctx.payload.get("prompt") if ctx.route == "completions" else None
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1
