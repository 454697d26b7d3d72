"""The Grafana dashboard and the Prometheus alert rules parse, and every metric they query is
one kvgate (or, for engine panels, vLLM / SGLang as kvgate reads them) exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvgate.routing.telemetry import _SIGNALS

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "config" / "grafana" / "kvgate.json"
ALERTS = ROOT / "config" / "prometheus" / "alerts.yaml"
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def exported_families() -> set[str]:
    """Metric family names written in kvgate's source (Counter, Gauge, Histogram, collectors)."""
    source = "\n".join(p.read_text() for p in (ROOT / "kvgate").rglob("*.py"))
    return set(re.findall(r'"(kvgate_[a-z_]+)"', source))


def queried(expr: str) -> set[str]:
    return set(re.findall(r"\b(kvgate_[a-z_]+|vllm:[a-z_]+|sglang:[a-z_]+)", expr))


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _unknown(exprs: list[str]) -> set[str]:
    families = exported_families()
    names = set().union(*(queried(e) for e in exprs))
    assert names, "nothing queried"
    return {
        n
        for n in names
        if (n.startswith("kvgate_") and _family(n) not in families)
        or (not n.startswith("kvgate_") and n not in _SIGNALS)
    }


def test_dashboard_is_valid_and_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvgate" and dashboard["panels"]
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert _unknown(exprs) == set()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in (
        "first token", "inter-token", "goodput", "per dollar", "cost by tenant", "queue",
        "breaker", "prefix hit", "drift", "kv",
    ):  # fmt: skip
        assert topic in titles


def test_alert_rules_are_valid_and_query_only_exported_metrics():
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} >= {
        "KvgateTimeToFirstTokenSLOBurn", "KvgateBreakerOpen", "KvgateRedisDown",
        "KvgatePrefixIndexDrift",
    }  # fmt: skip
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
    assert _unknown([r["expr"] for r in rules]) == set()


def test_an_unknown_metric_is_caught():
    assert _unknown(["rate(kvgate_no_such_metric_total[5m])"]) == {"kvgate_no_such_metric_total"}


def _documented_metrics() -> list[str]:
    """The metric families in docs/observability.md's tables, one per name written, where a
    row may add siblings by their differing end (`kvgate_a_b_total`, `_c_total` names
    `kvgate_a_c_total`)."""
    names: list[str] = []
    for line in (ROOT / "docs" / "observability.md").read_text().splitlines():
        if not line.startswith("| `kvgate_"):
            continue
        base = ""
        for name in re.findall(r"`([a-z_]+)`", line.split("|")[1]):
            if name.startswith("kvgate_"):
                base = name
            else:
                kept = 2 if base.endswith("_total") else 1
                name = base.rsplit("_", kept)[0] + name
            names.append(_family(name))
    return names


def test_the_observability_doc_lists_every_exported_metric_once():
    documented = _documented_metrics()
    assert len(documented) == len(set(documented)), "a metric documented twice"
    assert set(documented) == exported_families()
