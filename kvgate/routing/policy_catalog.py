"""Where a pool's `policy:` comes from: a built-in, a policy shipped with kvgate, or a file.

    policy: kvgate | random | round_robin | least_loaded   built into the code
    policy: latency | cost | balanced                      YAML shipped in the package
                                                           (kvgate/policies/, `kvgate policies`)
    policy: ./mine.yaml (any value ending in .yaml/.yml)   a file, relative to the config file

Policies are loaded where the app is assembled and by `kvgate check-config`, from a validated
`Config`; every problem names the pool's key path and the policy file's own line and key.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from kvgate.chain.settings import DEFAULT_TIERS
from kvgate.config import Config, ConfigError
from kvgate.routing.policy import PolicyError, RoutingPolicy, build_policy, load_policy
from kvgate.yaml_source import YamlSourceError, parse_yaml

# kvgate's default: the latency objective, with a saturation filter that only drops an endpoint
# whose queue is far beyond what its predicted-TTFT cost already prices. With the endpoints' own
# limit (5 waiting, when admission starts holding requests) a group left its prefix holder at
# the first short queue and the fleet thrashed its caches (benchmarks/RESULTS.md).
_KVGATE_POLICY: dict[str, Any] = {
    "name": "kvgate",
    "objective": "latency",
    "filters": ["jurisdiction", {"type": "not_saturated", "params": {"max_waiting": 32}}],
}
BUILTIN = ("kvgate", "random", "round_robin", "least_loaded")
_POLICY_FILES = (".yaml", ".yml")


def builtin_policy(name: str) -> RoutingPolicy:
    """`random`, `round_robin`, `least_loaded` (no scorers, engines queue) or `kvgate`."""
    if name == "kvgate":
        return build_policy(_KVGATE_POLICY, "<builtin:kvgate>")
    return build_policy(
        {"name": name, "filters": ["jurisdiction"], "scorers": [], "picker": name},
        f"<builtin:{name}>",
    )


def shipped_names() -> list[str]:
    """Names of the policy files shipped in the package (`latency`, `cost`, `balanced`)."""
    folder = resources.files("kvgate") / "policies"
    return sorted(
        entry.name.rsplit(".", 1)[0]
        for entry in folder.iterdir()
        if entry.name.endswith(_POLICY_FILES)
    )


def policy_names() -> list[str]:
    """Every name `policy:` accepts without a path."""
    return [*BUILTIN, *shipped_names()]


def shipped_text(name: str) -> str | None:
    """The YAML of a shipped policy, or None if there is no such policy."""
    if name not in shipped_names():
        return None
    return (resources.files("kvgate") / "policies" / f"{name}.yaml").read_text()


def resolve_policy(name: str, folder: Path | None) -> RoutingPolicy:
    """The policy `name` stands for (see the module docstring); raises PolicyError."""
    if name in BUILTIN:
        return builtin_policy(name)
    text = shipped_text(name)
    if text is not None:
        source = f"<shipped:{name}>"
        try:
            document = parse_yaml(text)
        except YamlSourceError as exc:
            raise PolicyError([f"{source}: {p}" for p in exc.problems]) from None
        return build_policy(document.data, source, document)
    if name.endswith(_POLICY_FILES):
        path = Path(name)
        if not path.is_absolute() and folder is not None:
            path = folder / path
        return load_policy(path)
    raise PolicyError(
        [f"unknown policy '{name}' (one of: {', '.join(policy_names())}, or a .yaml policy file)"]
    )


def load_policies(config: Config) -> dict[str, RoutingPolicy]:
    """Every pool's policy, by pool name; ConfigError lists every problem of every pool, and
    policies that name pools the config does not have."""
    policies: dict[str, RoutingPolicy] = {}
    problems: list[str] = []
    pool_names = {pool.name for pool in config.pools}
    tier_names = {*DEFAULT_TIERS, *config.tiers}
    for i, pool in enumerate(config.pools):
        try:
            policy = resolve_policy(pool.policy, config.folder)
        except PolicyError as exc:
            problems += [f"pools[{i}].policy: {problem}" for problem in exc.problems]
            continue
        unknown = sorted(policy.pools - pool_names)
        if unknown:
            problems.append(
                f"pools[{i}].policy: {pool.policy}: names pools the config does not have: "
                + ", ".join(unknown)
            )
        unknown = sorted(policy.tiers - tier_names)
        if unknown:
            problems.append(
                f"pools[{i}].policy: {pool.policy}: a rule matches tiers the config does not "
                "have (a rule that can never match): " + ", ".join(unknown)
            )
        policies[pool.name] = policy
    if problems:
        raise ConfigError(config.source, problems)
    return policies
