"""What kind of work a request is: the `Intent` the classify stage produces."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.chain.settings import LatencyClass
from kvgate.request_options import Workflow

# Lower rank is served first and shed last.
CLASS_RANK: dict[LatencyClass, int] = {"interactive": 0, "standard": 1, "batch": 2}
CLASSES_BY_RANK: tuple[LatencyClass, ...] = ("interactive", "standard", "batch")


def request_priority(latency_class: LatencyClass, tier_priority: int) -> int:
    """`ctx.priority`: lower runs first and is shed last; the class dominates the tier."""
    return CLASS_RANK[latency_class] * 100 + tier_priority


@dataclass(frozen=True, slots=True)
class Intent:
    """Deterministic summary of a request. `rule` names the rule that set the class and
    deadline (None: the tier's default); `residency_rules` the rules that narrowed the
    tenant's residency; `capped` is True when the tier lowered the class a rule asked for.
    `deadline` is seconds from arrival; `prompt_tokens` is the request's one estimate
    (`ctx.view.prompt_tokens`: characters / `classification.chars_per_token`, plus prompt
    tokens given as ids)."""

    model: str
    latency_class: LatencyClass
    prompt_tokens: int
    max_tokens: int
    tier: str
    deadline: float
    workflow: Workflow | None
    residency: frozenset[str] | None
    rule: str | None
    capped: bool = False
    residency_rules: tuple[str, ...] = ()

    @property
    def reserved_tokens(self) -> int:
        """Tokens reserved against tokens_per_minute at admission."""
        return self.prompt_tokens + self.max_tokens

    def explain(self) -> dict[str, object]:
        return {
            "model": self.model,
            "class": self.latency_class,
            "rule": self.rule,
            "capped_by_tier": self.capped,
            "tier": self.tier,
            "estimated_prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "deadline_seconds": self.deadline,
            "workflow": None
            if self.workflow is None
            else {"id": self.workflow.id, "step": self.workflow.step, "total": self.workflow.total},
            "residency": None if self.residency is None else sorted(self.residency),
            "residency_rules": list(self.residency_rules),
        }
