"""Routing policies: which filters, scorer weights, picker, pools and fallback a request gets.

A policy is data: YAML (the files shipped in `kvgate/policies/`, or a user's own), or one of
the built-ins `random`, `round_robin`, `least_loaded`, `kvgate` (`policy_catalog.py` finds
them). It has defaults and an ordered list of rules; the first rule whose `match` fits the
request (model glob, tenant tier, latency class, header values) overrides the defaults with its
own keys. Loading happens once, in stages: YAML → shape (unknown keys are errors) → build
plugins with their parameters → cross-check; every problem names the file, the line, the key
path and the reason, all at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails

from kvgate.chain.settings import LatencyClass
from kvgate.globs import compile_globs
from kvgate.routing.filters import Jurisdiction, NotSaturated
from kvgate.routing.plugins import (
    FILTERS,
    PICKERS,
    PREFIX_SCORERS,
    SCORERS,
    Filter,
    Picker,
    PluginType,
    Scorer,
)
from kvgate.types import RequestContext, header_value
from kvgate.yaml_source import (
    Loc,
    YamlDocument,
    YamlSourceError,
    key_path,
    read_yaml,
    schema_problem,
    shown_value,
)

T = TypeVar("T")

Objective = Literal["latency", "cost", "balanced"]
WhenSaturated = Literal["queue", "reject"]

# Scorer weights each objective uses when a policy names no scorers.
OBJECTIVE_SCORERS: dict[str, list[tuple[str, float]]] = {
    "latency": [("predicted_ttft", 10.0), ("session_affinity", 0.5), ("kv_usage", 0.2)],
    "cost": [
        ("endpoint_cost", 4.0),
        ("prefix_match", 3.0),
        ("predicted_ttft", 2.0),
        ("session_affinity", 0.5),
    ],
    "balanced": [
        ("predicted_ttft", 4.0),
        ("prefix_match", 2.0),
        ("queue_depth", 1.0),
        ("kv_usage", 1.0),
        ("endpoint_cost", 1.0),
        ("session_affinity", 0.5),
    ],
}
DEFAULT_FILTERS = ("jurisdiction", "not_saturated")


class PolicyError(Exception):
    """Problems in a policy file, each `file: key.path: reason`."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PluginSpec(_Strict):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


def _plugin_form(value: Any) -> str:
    return "one-of:name" if isinstance(value, str) else "one-of:mapping"


# A filter or picker is given by its name alone or as a mapping; the value's kind says which, so
# a slip in a mapping is reported against the mapping alone (not also as "not a string").
PluginRef = Annotated[
    Annotated[str, Tag("one-of:name")] | Annotated[PluginSpec, Tag("one-of:mapping")],
    Discriminator(_plugin_form),
]


class ScorerSpec(PluginSpec):
    # Strict: `true` or "2" is a slip in the file, not a weight.
    weight: float | None = Field(None, strict=True)


class FallbackSpec(_Strict):
    pool: str | None = None
    model: str | None = None

    @model_validator(mode="after")
    def _one(self) -> FallbackSpec:
        if (self.pool is None) == (self.model is None):
            raise ValueError("give exactly one of 'pool' or 'model'")
        return self


class MatchSpec(_Strict):
    model: str | None = None
    # Tiers are the config's (checked against it when the config loads its policies).
    tier: list[str] | None = None
    latency_class: list[LatencyClass] | None = None
    headers: dict[str, str] = Field(default_factory=dict)


class ProfileSpec(_Strict):
    objective: Objective | None = None
    filters: list[PluginRef] | None = None
    scorers: list[ScorerSpec] | None = None
    picker: PluginRef | None = None
    pools: list[str] | None = None
    when_saturated: WhenSaturated | None = None
    fallback: FallbackSpec | None = None


class RuleSpec(ProfileSpec):
    name: str | None = None
    match: MatchSpec = MatchSpec()


class PolicySpec(ProfileSpec):
    name: str | None = None
    description: str | None = None
    rules: list[RuleSpec] = Field(default_factory=list)


@dataclass(slots=True)
class RoutingProfile:
    """What routing does for the requests a rule (or the defaults) covers. The facts a decision
    needs about the profile itself (which filters judge saturation, whether a scorer reads the
    prefix match) are derived once, here, not per request."""

    objective: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker
    pools: tuple[str, ...] | None = None
    when_saturated: str = "queue"
    fallback_pool: str | None = None
    fallback_model: str | None = None
    plain_filters: list[Filter] = field(init=False)
    saturation_filters: list[Filter] = field(init=False)
    uses_prefix: bool = field(init=False)

    def __post_init__(self) -> None:
        self.saturation_filters = [f for f in self.filters if isinstance(f, NotSaturated)]
        self.plain_filters = [f for f in self.filters if not isinstance(f, NotSaturated)]
        self.uses_prefix = any(s.NAME in PREFIX_SCORERS for s, _ in self.scorers)


@dataclass(slots=True)
class Rule:
    """A rule's match, with its glob patterns compiled once (model, header values)."""

    name: str
    match: MatchSpec
    profile: RoutingProfile
    model: re.Pattern[str] | None = field(init=False)
    headers: list[tuple[bytes, re.Pattern[str]]] = field(init=False)

    def __post_init__(self) -> None:
        m = self.match
        self.model = compile_globs([m.model]) if m.model is not None else None
        self.headers = [
            (name.lower().encode("latin-1"), compile_globs([pattern]))
            for name, pattern in m.headers.items()
        ]

    def matches(self, ctx: RequestContext) -> bool:
        m = self.match
        if self.model is not None and self.model.fullmatch(ctx.model) is None:
            return False
        if m.tier is not None and ctx.tier not in m.tier:
            return False
        if m.latency_class is not None:
            latency_class = ctx.intent.latency_class if ctx.intent is not None else None
            if latency_class not in m.latency_class:
                return False
        for name, pattern in self.headers:
            value = header_value(ctx.client_headers, name)
            if value is None or pattern.fullmatch(value.decode("latin-1")) is None:
                return False
        return True


@dataclass(slots=True)
class RoutingPolicy:
    name: str
    default: RoutingProfile
    rules: list[Rule] = field(default_factory=list)

    def profile_for(self, ctx: RequestContext) -> tuple[RoutingProfile, str]:
        """The profile of the first matching rule (and its name), else the defaults."""
        for rule in self.rules:
            if rule.matches(ctx):
                return rule.profile, rule.name
        return self.default, "default"

    @property
    def uses_prefix(self) -> bool:
        return self.default.uses_prefix or any(r.profile.uses_prefix for r in self.rules)

    @property
    def tiers(self) -> set[str]:
        """Every tier the policy's rules match (to cross-check against the config)."""
        return {tier for rule in self.rules for tier in rule.match.tier or ()}

    @property
    def pools(self) -> set[str]:
        """Every pool the policy names (to cross-check against the config)."""
        named: set[str] = set()
        for profile in [self.default, *(r.profile for r in self.rules)]:
            named.update(profile.pools or ())
            if profile.fallback_pool:
                named.add(profile.fallback_pool)
        return named


# A problem found while building a policy: where in the file (a key path, placed on its line
# when the file's marks are known), and what is wrong there.
_Problem = tuple[Loc, str]


def _build(
    registry: dict[str, PluginType[T]],
    kind: str,
    spec: str | PluginSpec,
    where: Loc,
    problems: list[_Problem],
) -> T | None:
    plugin_type = spec if isinstance(spec, str) else spec.type
    params = {} if isinstance(spec, str) else spec.params
    cls = registry.get(plugin_type)
    if cls is None:
        known = ", ".join(sorted(registry))
        problems.append((where, f"unknown {kind} '{plugin_type}' (one of: {known})"))
        return None
    try:
        return cls.create(cls.params.model_validate(params))
    except ValidationError as exc:
        for error in exc.errors():
            loc, message = schema_problem(error, cls.params)
            problems.append(((*where, "params", *loc), message))
        return None


def _profile(
    spec: ProfileSpec, base: ProfileSpec | None, where: Loc, problems: list[_Problem]
) -> RoutingProfile | None:
    """The profile `spec` describes (keys it lacks come from `base`), or None when a plugin
    could not be built (the reason is in `problems`)."""

    def pick(key: str) -> Any:
        value = getattr(spec, key)
        return value if value is not None or base is None else getattr(base, key)

    objective = pick("objective") or "latency"
    filter_specs = pick("filters")
    filters_where: Loc
    if filter_specs is None:
        filter_specs = list(DEFAULT_FILTERS)
        filters_where = (*where, "objective")
    else:
        filters_where = (*where, "filters") if spec.filters is not None else ("filters",)
    filters = [
        _build(FILTERS, "filter", f, (*filters_where, i), problems)
        for i, f in enumerate(filter_specs)
    ]
    if not any(isinstance(f, Jurisdiction) for f in filters):
        # Residency is the tenant's, not the policy's to drop: a list without the filter gets
        # it first (one that lists it chooses its place and the label it reads).
        residency = FILTERS[Jurisdiction.NAME]
        filters.insert(0, residency.create(residency.params()))
    scorer_specs = pick("scorers")
    scorers: list[tuple[Scorer, float]] = []
    if scorer_specs is None:
        for name, weight in OBJECTIVE_SCORERS[objective]:
            plugin = SCORERS[name]
            scorers.append((plugin.create(plugin.params()), weight))
    else:
        scorers_where = (*where, "scorers") if spec.scorers is not None else ("scorers",)
        for i, s in enumerate(scorer_specs):
            here = (*scorers_where, i)
            scorer = _build(SCORERS, "scorer", s, here, problems)
            if s.weight is None:
                problems.append(((*here, "weight"), "a scorer needs a weight"))
            elif s.weight <= 0:
                problems.append(((*here, "weight"), f"must be greater than 0 (got {s.weight})"))
            elif scorer is not None:
                scorers.append((scorer, s.weight))
    picker_spec = pick("picker") or "max_score"
    picker = _build(
        PICKERS,
        "picker",
        picker_spec,
        (*where, "picker") if spec.picker is not None else ("picker",),
        problems,
    )
    if picker is None:
        return None
    fallback = pick("fallback")
    return RoutingProfile(
        objective=objective,
        filters=[f for f in filters if f is not None],
        scorers=scorers,
        picker=picker,
        pools=tuple(pools) if (pools := pick("pools")) else None,
        when_saturated=pick("when_saturated") or "queue",
        fallback_pool=fallback.pool if fallback else None,
        fallback_model=fallback.model if fallback else None,
    )


def build_policy(data: Any, source: str, document: YamlDocument | None = None) -> RoutingPolicy:
    """Validate a parsed policy tree and build its plugins; PolicyError lists every problem
    (on the lines of `document`, when given)."""
    if document is not None and document.duplicates:
        raise PolicyError([f"{source}: {problem}" for problem in document.duplicates])
    if not isinstance(data, dict):
        raise PolicyError([f"{source}: (top level): must be a mapping of keys to values"])
    problems: list[_Problem] = []
    try:
        spec = PolicySpec.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        problems.extend(_schema_problem(e) for e in errors)
        # Unknown keys alone (a slip such as `pickr:`) hide nothing else: the file is checked
        # on without them, so one run lists every problem.
        if any(e["type"] != "extra_forbidden" for e in errors):
            _raise(problems, source, document)
        spec = PolicySpec.model_validate(_without(data, [e["loc"] for e in errors]))
    default = _profile(spec, None, (), problems)
    profiles = [_profile(r, spec, ("rules", i), problems) for i, r in enumerate(spec.rules)]
    named: dict[str, int] = {}
    for i, rule in enumerate(spec.rules):
        if rule.name is None:
            continue
        if rule.name in named:
            # Explanations and metrics say which rule decided by its name.
            problems.append(
                (("rules", i, "name"), f"duplicate rule name, also rules[{named[rule.name]}]")
            )
        named.setdefault(rule.name, i)
    if problems:
        _raise(problems, source, document)
    assert default is not None and all(p is not None for p in profiles)
    rules = [
        Rule(r.name or f"rules[{i}]", r.match, profile)
        for i, (r, profile) in enumerate(zip(spec.rules, profiles, strict=True))
        if profile is not None
    ]
    return RoutingPolicy(spec.name or Path(source).stem, default, rules)


def _schema_problem(error: ErrorDetails) -> _Problem:
    loc, message = schema_problem(error, PolicySpec)
    if error["type"] == "model_type" and error["loc"][-1] == "one-of:mapping":
        given = shown_value(loc, error["input"])
        message = f"must be a plugin's name or a mapping with its `type` (got {given})"
    return loc, message


def _without(data: dict[str, Any], locs: list[tuple[str | int, ...]]) -> dict[str, Any]:
    """A copy of `data` without the keys at `locs` (paths through mappings and lists)."""
    copy: Any = _copy_tree(data)
    for loc in locs:
        node = copy
        for part in loc[:-1]:
            if isinstance(part, str) and part.startswith("one-of:"):
                continue
            node = node[part]
        node.pop(loc[-1], None)
    return dict(copy)


def _copy_tree(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _copy_tree(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_copy_tree(v) for v in node]
    return node


def _raise(problems: list[_Problem], source: str, document: YamlDocument | None) -> NoReturn:
    """Raise PolicyError with `problems`, each once (a rule that inherits the policy's filters
    or scorers meets their problems again)."""
    raise PolicyError(
        [
            f"{source}: {document.where(loc) if document else key_path(loc)}: {message}"
            for loc, message in dict.fromkeys(problems)
        ]
    )


def load_policy(path: str | Path) -> RoutingPolicy:
    """Read and build a policy file."""
    source = str(path)
    try:
        document = read_yaml(path)
    except YamlSourceError as exc:
        raise PolicyError([f"{source}: {problem}" for problem in exc.problems]) from None
    return build_policy(document.data, source, document)
