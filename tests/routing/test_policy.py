"""Policy files: the shipped ones load; broken ones are rejected with file, key path, reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvgate.config import ConfigError, load_config, parse_config
from kvgate.routing.policy import PolicyError, build_policy, load_policy
from kvgate.routing.policy_catalog import (
    builtin_policy,
    load_policies,
    policy_names,
    resolve_policy,
    shipped_text,
)
from tests.routing.helpers import ctx

POLICIES = Path(__file__).resolve().parents[2] / "kvgate" / "policies"


@pytest.mark.parametrize("name", ["latency", "cost", "balanced"])
def test_shipped_policies_load_by_name_and_by_path(name):
    by_name = resolve_policy(name, None)
    assert by_name.name == name
    assert by_name.default.scorers and by_name.uses_prefix
    assert load_policy(POLICIES / f"{name}.yaml").name == name
    assert shipped_text(name) == (POLICIES / f"{name}.yaml").read_text()


def test_policy_names_are_the_builtins_and_the_shipped_files():
    assert policy_names() == [
        "kvgate", "random", "round_robin", "least_loaded", "balanced", "cost", "latency"
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["random", "round_robin", "least_loaded", "kvgate"])
def test_builtin_policies(name):
    policy = builtin_policy(name)
    assert ("max_score" if name == "kvgate" else name) == policy.default.picker.NAME
    assert policy.uses_prefix == (name == "kvgate")


BAD = [
    ({"scorers": [{"type": "prefix_match"}]}, "scorers[0].weight: a scorer needs a weight"),
    ({"scorers": [{"type": "prefix_match", "weight": 0}]}, "scorers[0].weight: must be greater"),
    ({"scorers": [{"type": "nope", "weight": 1}]}, "scorers[0]: unknown scorer 'nope'"),
    (
        {"filters": ["not_saturated", {"type": "labels", "params": {"mtach": {}}}]},
        "filters[1].params.mtach: unknown key (did you mean 'match'?)",
    ),
    (
        {"picker": {"type": "max_score", "params": {"tie_margin": 2}}},
        "picker.params.tie_margin: Input should be less than or equal to 1",
    ),
    ({"objective": "fastest"}, "objective: Input should be"),
    (
        {"rules": [{"match": {"model": "x"}, "scorers": [{"type": "inflight"}]}]},
        "rules[0].scorers[0].weight: a scorer needs a weight",
    ),
    ({"rules": [{"matc": {}}]}, "rules[0].matc: unknown key (did you mean 'match'?)"),
    ({"filters": [5]}, "filters[0]: must be a plugin's name or a mapping with its `type` (got 5)"),
    ({"fallback": {"pool": "a", "model": "b"}}, "fallback: give exactly one of"),
    ([1, 2], "(top level): must be a mapping"),
    # A weight that is not a finite number would make every request fail.
    (
        {"scorers": [{"type": "kv_usage", "weight": float("nan")}]},
        "scorers[0].weight: Input should be a finite number",
    ),
    (
        {"scorers": [{"type": "kv_usage", "weight": float("inf")}]},
        "scorers[0].weight: Input should be a finite number",
    ),
    (
        {"scorers": [{"type": "kv_usage", "weight": True}]},
        "scorers[0].weight: Input should be a valid number",
    ),
    (
        {"rules": [{"match": {"latency_class": ["urgent"]}, "objective": "cost"}]},
        "rules[0].match.latency_class[0]: Input should be 'interactive', 'standard' or 'batch'",
    ),
    (
        {
            "rules": [
                {"name": "eu", "match": {"model": "a"}, "objective": "cost"},
                {"name": "eu", "match": {"model": "b"}, "objective": "latency"},
            ]
        },
        "rules[1].name: duplicate rule name, also rules[0]",
    ),
    ({"filters": ["labels"]}, "filters[0].params.match: Field required"),
    (
        {"filters": [{"type": "labels", "params": {"match": {}}}]},
        "filters[0].params.match: Dictionary should have at least 1 item",
    ),
]


@pytest.mark.parametrize(("data", "problem"), BAD, ids=[b[1][:40] for b in BAD])
def test_bad_policy_is_rejected_with_path_and_reason(data, problem):
    with pytest.raises(PolicyError) as caught:
        build_policy(data, "policies/x.yaml")
    assert any(p.startswith("policies/x.yaml: ") and problem in p for p in caught.value.problems), (
        caught.value.problems
    )


def test_one_check_lists_every_problem_of_a_policy_with_mistyped_keys():
    """A mistyped key (`pickr:`) hides none of the other problems, a filter given as a mapping
    is not also reported as "not a string", and a problem of the policy's own filters or
    scorers is listed once, not again for each rule that inherits them."""
    data = {
        "pickr": "max_score",
        "filters": ["not_saturatd", {"typ": "labels"}],
        "scorers": [{"type": "predicted_tft", "weight": 0}],
        "rules": [{"name": "r", "mach": {"model": "x"}}],
    }
    with pytest.raises(PolicyError) as caught:
        build_policy(data, "x.yaml")
    assert caught.value.problems == [
        "x.yaml: filters[1].type: Field required",
        "x.yaml: filters[1].typ: unknown key (did you mean 'type'?)",
        "x.yaml: rules[0].mach: unknown key (did you mean 'match'?)",
        "x.yaml: pickr: unknown key (did you mean 'picker'?)",
    ]
    del data["filters"][1]
    with pytest.raises(PolicyError) as caught:
        build_policy(data, "x.yaml")
    assert caught.value.problems == [
        "x.yaml: rules[0].mach: unknown key (did you mean 'match'?)",
        "x.yaml: pickr: unknown key (did you mean 'picker'?)",
        "x.yaml: filters[0]: unknown filter 'not_saturatd' (one of: fresh_telemetry, "
        "jurisdiction, labels, not_saturated)",
        "x.yaml: scorers[0]: unknown scorer 'predicted_tft' (one of: endpoint_cost, inflight, "
        "kv_usage, predicted_ttft, prefix_match, queue_depth, session_affinity)",
        "x.yaml: scorers[0].weight: must be greater than 0 (got 0.0)",
    ]


def test_config_names_policy_file_errors_under_the_pool(tmp_path):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"scorers": [{"type": "kv_usage"}]}))
    (tmp_path / "gw.yaml").write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {"name": "a", "policy": "bad.yaml", "endpoints": [{"url": "http://e:1"}]},
                    {"name": "b", "policy": "missing.yaml", "endpoints": [{"url": "http://e:2"}]},
                    {"name": "c", "policy": "fastest", "endpoints": [{"url": "http://e:3"}]},
                ]
            }
        )
    )
    with pytest.raises(ConfigError) as caught:
        load_policies(load_config(tmp_path / "gw.yaml"))
    problems = caught.value.problems
    # On the line of the scorer that lacks its weight.
    assert (
        f"pools[0].policy: {tmp_path / 'bad.yaml'}: line 2, column 3: scorers[0].weight: a "
        "scorer needs a weight" in problems
    )
    assert any(
        p.startswith(f"pools[1].policy: {tmp_path / 'missing.yaml'}: (file): cannot read")
        for p in problems
    )
    assert any(p.startswith("pools[2].policy: unknown policy 'fastest'") for p in problems)


def test_policies_load_from_a_config_by_name_path_and_relative_path(tmp_path):
    (tmp_path / "mine.yaml").write_text((POLICIES / "balanced.yaml").read_text())
    (tmp_path / "gw.yaml").write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {"name": "a", "policy": str(POLICIES / "cost.yaml"),
                     "endpoints": [{"url": "http://e:1"}]},
                    {"name": "b", "policy": "latency", "endpoints": [{"url": "http://e:2"}]},
                    {"name": "c", "policy": "./mine.yaml", "endpoints": [{"url": "http://e:3"}]},
                    {"name": "d", "endpoints": [{"url": "http://e:4"}]},
                ]
            }
        )
    )  # fmt: skip
    policies = load_policies(load_config(tmp_path / "gw.yaml"))
    assert {pool: p.name for pool, p in policies.items()} == {
        "a": "cost", "b": "latency", "c": "balanced", "d": "kvgate"
    }  # fmt: skip


def test_policy_naming_a_pool_the_config_lacks_is_an_error(tmp_path):
    source = tmp_path / "big.yaml"
    source.write_text(yaml.safe_dump({"name": "x", "pools": ["gpu-big"]}))
    pools = [{"name": "a", "policy": str(source), "endpoints": [{"url": "http://e:1"}]}]
    with pytest.raises(ConfigError, match="names pools the config does not have: gpu-big"):
        load_policies(parse_config({"pools": pools}))


def test_policy_rule_matching_a_tier_the_config_lacks_is_an_error(tmp_path):
    source = tmp_path / "tiers.yaml"
    source.write_text(
        yaml.safe_dump({"rules": [{"match": {"tier": ["gold", "platinum"]}, "objective": "cost"}]})
    )
    pools = [{"name": "a", "policy": str(source), "endpoints": [{"url": "http://e:1"}]}]
    with pytest.raises(ConfigError, match=r"matches tiers the config does not have.*: platinum$"):
        load_policies(parse_config({"pools": pools}))
    tiers = {"platinum": {"priority": 0, "weight": 8}}
    load_policies(parse_config({"pools": pools, "tiers": tiers}))


def test_rules_match_model_tier_class_and_headers():
    policy = build_policy(
        {
            "rules": [
                {"name": "hdr", "match": {"headers": {"X-Team": "search-*"}}, "objective": "cost"},
                {
                    "name": "gold",
                    "match": {"model": "big-*", "tier": ["gold"]},
                    "objective": "balanced",
                },
            ]
        },
        "p.yaml",
    )
    request = ctx(model="big-1")
    assert policy.profile_for(request)[1] == "default"
    request.tier = "gold"
    assert policy.profile_for(request)[1] == "gold"
    request.client_headers = [(b"x-team", b"search-eu")]
    profile, rule = policy.profile_for(request)
    assert (rule, profile.objective) == ("hdr", "cost")
    assert next(s.NAME for s, _ in profile.scorers) == "endpoint_cost"
