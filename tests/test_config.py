"""Config loading: the documented minimal file, env substitution, and errors naming key paths."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from kvgate.config import ConfigError, load_config, parse_config

MINIMAL = """\
server:
  port: 8080
pools:
  - name: default
    engine: vllm
    models: [sim-model]
    endpoints:
      - url: http://127.0.0.1:9100
      - url: http://127.0.0.1:9101
"""


def _write(tmp_path, text: str):
    path = tmp_path / "kvgate.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_minimal_file_from_the_docs_loads_exactly_as_written(tmp_path):
    config = load_config(_write(tmp_path, MINIMAL))
    assert config.server.port == 8080
    pool = config.pools[0]
    assert (pool.name, pool.engine, pool.models) == ("default", "vllm", ["sim-model"])
    assert [e.url for e in pool.endpoints] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert config.state.backend == "memory"
    assert config.server.max_body_bytes == 10 * 1024 * 1024


@pytest.mark.parametrize(
    "path",
    [
        "config/single-node.yaml",
        "config/demo.yaml",
        "config/multi-replica.yaml",
        "config/tenants.yaml",
    ],
)
def test_shipped_example_configs_load(path, monkeypatch):
    monkeypatch.setenv("ENGINE_API_KEY", "k")
    load_config(path)


def test_env_substitution_with_default(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_KEY", "s3cret")
    config = load_config(
        _write(
            tmp_path,
            """\
        pools:
          - name: p
            endpoints:
              - url: http://${ENGINE_HOST:-127.0.0.1}:9100
                api_key: ${ENGINE_KEY}
        """,
        )
    )
    assert config.pools[0].endpoints[0].url == "http://127.0.0.1:9100"
    assert config.pools[0].endpoints[0].api_key == "s3cret"


def _problems(tmp_path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert str(tmp_path) in str(info.value)
    return info.value.problems


def test_every_problem_is_reported_with_its_key_path(tmp_path, monkeypatch):
    monkeypatch.delenv("MISSING_KEY", raising=False)
    problems = _problems(
        tmp_path,
        """\
        server:
          prot: 8080
        pools:
          - name: a
            engine: tgi
            endpoints:
              - url: ftp://x
                api_key: ${MISSING_KEY}
          - name: b
            endpoints: []
        """,
    )
    assert "line 2, column 3: server.prot: unknown key (did you mean 'port'?)" in problems
    assert any(
        p.startswith("line 5, column 5: pools[0].engine:") and "vllm" in p and "(got 'tgi')" in p
        for p in problems
    )
    assert any(
        p.startswith("line 7, column 9: pools[0].endpoints[0].url:") and "(got 'ftp://x')" in p
        for p in problems
    )
    assert (
        "line 8, column 9: pools[0].endpoints[0].api_key: environment variable MISSING_KEY is "
        "not set" in problems
    )
    assert any(p.startswith("line 10, column 5: pools[1].endpoints:") for p in problems)


def test_a_value_whose_variable_is_unset_is_reported_once(tmp_path, monkeypatch):
    """Not also as the empty string the reference became (`sha256: must be 64 hex digits`)."""
    for name in ("ADMIN_SHA", "HOST", "PORT"):
        monkeypatch.delenv(f"KVGATE_TEST_{name}", raising=False)
    problems = _problems(
        tmp_path,
        """\
        auth:
          admin_keys: [{id: ops-1, sha256: "${KVGATE_TEST_ADMIN_SHA}"}]
        pools:
          - name: a
            endpoints: [{url: "http://${KVGATE_TEST_HOST}:${KVGATE_TEST_PORT}"}]
        """,
    )
    assert problems == [
        "line 2, column 28: auth.admin_keys[0].sha256: environment variable "
        "KVGATE_TEST_ADMIN_SHA is not set",
        "line 5, column 18: pools[0].endpoints[0].url: environment variable KVGATE_TEST_HOST is "
        "not set",
        "line 5, column 18: pools[0].endpoints[0].url: environment variable KVGATE_TEST_PORT is "
        "not set",
    ]


@pytest.mark.parametrize(
    "query", ["ssl_keyfile=x", "socket_timeout=soon", "health_check_interval=often"]
)
def test_a_redis_url_the_client_cannot_use_is_a_config_problem(tmp_path, query):
    """Found at load (so `check-config` finds it), not as a crash when the gateway starts; the
    URL's password is not shown."""
    problems = _problems(
        tmp_path,
        f"""\
        state:
          backend: redis
          url: redis://:hunter2@127.0.0.1:6379/0?{query}
        pools:
          - name: a
            endpoints:
              - url: http://127.0.0.1:9
        """,
    )
    assert any(
        p.startswith("line 3, column 3: state.url: redis cannot use this URL") for p in problems
    )
    assert not any("hunter2" in p for p in problems)


@pytest.mark.parametrize("cost", ["0", "-1", "cheap", "nan", "inf"])
def test_a_cost_label_the_cost_scorer_cannot_use_is_a_config_problem(cost):
    endpoint = {"url": "http://e:1", "labels": {"cost": cost}}
    with pytest.raises(ConfigError) as caught:
        parse_config({"pools": [{"name": "a", "endpoints": [endpoint]}]})
    (problem,) = caught.value.problems
    assert problem.startswith("pools[0].endpoints[0].labels: 'cost' must be a positive number")


def test_kv_event_sockets_past_65535_or_shared_by_two_engines_are_config_problems():
    sim = {"kind": "sim"}
    past = {"name": "a", "kv_events": {"port_offset": 60000}, "tokenizer": sim}
    past["endpoints"] = [{"url": "http://h:17100"}]
    shared = {"name": "b", "tokenizer": sim}
    shared["endpoints"] = [
        {"url": f"http://h:{port}", "kv_events": {"url": "tcp://h:5557"}} for port in (1, 2)
    ]
    with pytest.raises(ConfigError) as caught:
        parse_config({"pools": [past, shared]})
    assert caught.value.problems == [
        "pools[0].kv_events.port_offset: pools[0].endpoints[0]'s KV-event socket tcp://h:77100 "
        "is past port 65535",
        "pools[1].endpoints[1].kv_events.url: pools[1].endpoints[1]'s KV events at tcp://h:5557 "
        "are also pools[1].endpoints[0]'s (one engine's events would be taken for another's)",
    ]


def test_kv_event_sockets_an_engine_cannot_be_reached_on_are_config_problems():
    """vLLM's own bind address (`tcp://*:5557`) copied as the URL to connect to; a replay
    socket that is the PUB socket; a replay offset one above the PUB offset, which lands on
    the next engine's PUB port. Each is refused at load, not found as a silent approximate
    endpoint at runtime."""
    sim = {"kind": "sim"}
    same = {"url": "tcp://h:20200", "replay_url": "tcp://h:20200"}
    star = {"name": "a", "tokenizer": sim}
    star["endpoints"] = [
        {"url": "http://h:1", "kv_events": {"url": "tcp://*:20100"}},
        {"url": "http://h:2", "kv_events": same},
    ]
    offsets = {"name": "b", "tokenizer": sim}
    offsets["endpoints"] = [{"url": "http://g:19100"}, {"url": "http://g:19101"}]
    offsets["kv_events"] = {"port_offset": 1000, "replay_port_offset": 1001}
    with pytest.raises(ConfigError) as caught:
        parse_config({"pools": [star, offsets]})
    assert caught.value.problems == [
        "pools[0].endpoints[0].kv_events.url: tcp://*:20100 is an address to bind (as vLLM's "
        "--kv-events-config gives it), not one to connect to: name the engine's host",
        "pools[0].endpoints[1].kv_events.replay_url: pools[0].endpoints[1]'s KV-event replay "
        "socket is its PUB socket (tcp://h:20200)",
        "pools[1].kv_events.replay_port_offset: pools[1].endpoints[0]'s KV-event replay socket "
        "tcp://g:20101 is pools[1].endpoints[1]'s PUB socket (a replay offset one above the PUB "
        "offset lands on the next engine's port)",
    ]


def test_secret_values_are_masked_in_problems(tmp_path):
    problems = _problems(
        tmp_path,
        """        pools:
          - name: a
            endpoints:
              - url: http://h:1
                api_key: [not, a, string, hunter2]
        """,
    )
    (problem,) = problems
    assert problem.startswith("line 5, column 9: pools[0].endpoints[0].api_key:")
    assert "'***'" in problem and "hunter2" not in problem


def test_values_under_keys_that_only_mention_tokens_are_shown(tmp_path):
    """`default_max_tokens` and `first_token` name no secret: their bad values are shown."""
    sections = {
        "pools": [{"name": "a", "endpoints": [{"url": "http://h:1"}]}],
        "timeouts": {"first_token": -1},
        "classification": {"default_max_tokens": -3},
    }
    problems = _problems(tmp_path, yaml.safe_dump(sections))
    assert any("first_token" in p and "(got -1)" in p for p in problems), problems
    assert any("default_max_tokens" in p and "(got -3)" in p for p in problems), problems


def test_cross_checks_duplicates(tmp_path):
    problems = _problems(
        tmp_path,
        """\
        pools:
          - name: a
            endpoints: [{url: "http://h:1"}]
          - name: a
            endpoints: [{url: "http://h:1"}]
        """,
    )
    assert "pools[1].name: duplicate pool name 'a'" in problems
    assert (
        "pools[1].endpoints[0].url: duplicate endpoint, already in pools[0].endpoints[0].url"
        in problems
    )


_NAMED_ENDPOINTS = """\
pools:
  - name: a
    endpoints:
      - {url: "http://h:1", name: a-1}
      - {url: "http://h:2"}
      - {url: "http://h:3", name: "h100.node-7:8000"}
  - name: b
    endpoints:
      - {url: "http://h:4", name: "h100.node-7:8000"}
"""


def test_endpoint_names_are_header_safe(tmp_path):
    """An endpoint's own `name` must fit a header, a metric label and a URL path segment."""
    bad = '      - {url: "http://h:5", name: "gpu/5"}\n      - {url: "http://h:6", name: ""}\n'
    rule = (
        "1 to 64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit (it goes "
        "into a response header, a metric label and an admin URL path)"
    )
    assert _problems(tmp_path, _NAMED_ENDPOINTS + bad) == [
        f"line 10, column 29: pools[1].endpoints[1].name: {rule} (got 'gpu/5')",
        f"line 11, column 29: pools[1].endpoints[2].name: {rule} (got '')",
    ]


def test_endpoint_names_are_unique(tmp_path):
    """An endpoint's own `name` may not take another's, its pool's default names included
    (`{pool}-{index}`)."""
    assert _problems(tmp_path, _NAMED_ENDPOINTS) == [
        "pools[0].endpoints[1].name: endpoint name 'a-1' is also pools[0].endpoints[0]'s "
        "(names label metrics and headers; give one of them a `name:` of its own)",
        "pools[1].endpoints[0].name: endpoint name 'h100.node-7:8000' is also "
        "pools[0].endpoints[2]'s (names label metrics and headers; give one of them a `name:` "
        "of its own)",
    ]


def test_two_keys_with_one_secret_are_refused(tmp_path):
    """Keys are found by their digest: two with one would leave one of them working as the
    other (a tenant's secret opening the admin routes), so the config is refused."""
    digest = "b1" * 32
    problems = _problems(
        tmp_path,
        f"""\
        auth:
          tenants:
            - name: acme
              keys: [{{id: a1, sha256: "{digest}"}}]
            - name: other
              keys: [{{id: o1, sha256: "{digest.upper()}"}}]
          admin_keys:
            - {{id: ad1, sha256: "{digest}"}}
        pools:
          - name: a
            endpoints: [{{url: "http://h:1"}}]
        """,
    )
    same = "the same secret as auth.tenants[0].keys[0] (every key needs its own)"
    assert f"auth.tenants[1].keys[0].sha256: {same}" in problems
    assert f"auth.admin_keys[0].sha256: {same}" in problems


def test_a_residency_no_endpoint_is_labelled_with_is_refused(tmp_path):
    """A tenant's or a rule's residency naming a place no endpoint's label has (a typo, `ue`
    for `eu`) would refuse every request kept there: the config is refused and the place is
    named. A place carried by any label (the jurisdiction filter may read `region`) is
    fine."""
    problems = _problems(
        tmp_path,
        f"""\
        auth:
          tenants:
            - name: acme
              keys: [{{id: a1, sha256: "{"c1" * 32}"}}]
              residency: [ue, eu]
            - name: other
              keys: [{{id: o1, sha256: "{"c2" * 32}"}}]
              residency: [eu-west]
        classification:
          rules:
            - {{name: mars, when: {{regex: Mars}}, then: {{residency: [mars]}}}}
            - {{name: eu, when: {{regex: GDPR}}, then: {{residency: [eu]}}}}
        pools:
          - name: a
            endpoints:
              - {{url: "http://h:1", labels: {{jurisdiction: eu}}}}
              - {{url: "http://h:2", labels: {{region: eu-west}}}}
        """,
    )
    assert [p.partition(":")[0] for p in problems] == [
        "auth.tenants[0].residency",
        "classification.rules[0].then.residency",
    ], problems
    assert "no endpoint has a label 'ue'" in problems[0]
    assert "no endpoint has a label 'mars'" in problems[1]


def test_invalid_yaml_names_the_line(tmp_path):
    problems = _problems(tmp_path, "pools: [\n  - name: a\n")
    assert problems[0].startswith("line ")


def test_a_key_written_twice_is_refused_not_silently_overridden(tmp_path):
    problems = _problems(
        tmp_path,
        """\
        server:
          port: 8080
          port: 9090
        pools:
          - name: a
            endpoints: [{url: "http://h:1"}]
            name: b
        """,
    )
    assert problems == [
        "line 3, column 3: server.port: duplicate key (first written at line 2); YAML would"
        " keep only this one",
        "line 7, column 5: pools[0].name: duplicate key (first written at line 5); YAML would"
        " keep only this one",
    ]


def test_one_run_reports_every_kind_of_problem(tmp_path):
    """One run of check-config names a key written twice, what is wrong in the values, and
    what is wrong between the sections that are valid, not one kind at a time (a fix, a run,
    and then the next)."""
    digest = "a" * 64
    problems = _problems(
        tmp_path,
        f"""\
        server:
          port: 8080
          port: 9090
          prot: 1
        state: {{backend: redis}}
        auth:
          tenants:
            - {{name: acme, tier: platinum, keys: [{{id: a1, sha256: "{digest}"}}]}}
        pools:
          - name: a
            engine: vlm
            endpoints: [{{url: "http://h:1", max_inflight: -3}}]
        """,
    )
    assert problems[0].startswith("line 3, column 3: server.port: duplicate key")
    assert any(p.startswith("line 4, column 3: server.prot: unknown key") for p in problems)
    assert any("pools[0].engine" in p for p in problems), problems
    assert any("pools[0].endpoints[0].max_inflight" in p for p in problems), problems
    assert "state.url: required when state.backend is 'redis'" in problems
    assert any(p.startswith("auth.tenants[0].tier: unknown tier 'platinum'") for p in problems)


def test_missing_pools_and_wrong_top_level(tmp_path):
    assert _problems(tmp_path, "server: {port: 1}\n") == ["pools: Field required"]
    with pytest.raises(ConfigError):
        parse_config(["not", "a", "mapping"])
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    assert "cannot read" in info.value.problems[0]


def test_an_endpoint_url_ending_in_v1_is_refused(tmp_path):
    problems = _problems(
        tmp_path,
        """\
        pools:
          - name: a
            endpoints: [{url: "http://h:8000/v1/"}]
        """,
    )
    (problem,) = problems
    assert "pools[0].endpoints[0].url" in problem and "without /v1" in problem
