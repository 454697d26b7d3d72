"""deploy/: every YAML parses, every kvgate config in it loads, every referenced file exists,
and the pieces name each other consistently (Compose services, nginx, Prometheus; Kubernetes
objects, probes, the autoscaler and the engines the config lists)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvgate.config import ServerConfig, load_config
from kvgate.routing.policy_catalog import load_policies
from kvgate.serving import uvicorn_options

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose"
KUBE = DEPLOY / "kubernetes"
# How long kvgate may take to exit on SIGTERM: the drain it gives requests in flight (the
# config in deploy/ keeps the default) and the second after it for their error events.
GRACEFUL_SHUTDOWN_SECONDS = uvicorn_options(
    "127.0.0.1", 0, "info", "json", drain_seconds=ServerConfig().drain_seconds
)["timeout_graceful_shutdown"]


def _documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path):
    assert _documents(path), f"{path} holds no YAML document"


# --- Compose --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def _bind_sources(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) of every bind mount written `./x:/y[:ro]`."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append((source, target))
    return mounts


def test_compose_references_only_files_in_the_repository(compose: dict[str, Any]):
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = (COMPOSE / build["context"]).resolve()
            assert context == ROOT, f"{name}: builds from outside the repository"
            assert (context / build.get("dockerfile", "Dockerfile")).is_file()
        for source, _ in _bind_sources(service):
            assert not source.startswith("/"), f"{name}: {source} is outside the repository"
            path = (COMPOSE / source).resolve()
            assert path.exists(), f"{name}: mounts {source}, which does not exist"
            assert path.is_relative_to(ROOT)


def test_compose_runs_two_gateways_behind_one_port_over_redis_and_four_engines(
    compose: dict[str, Any],
):
    services = compose["services"]
    gateways = [n for n, s in services.items() if s.get("command") == ["serve"]]
    assert len(gateways) == 2
    published = [n for n, s in services.items() if "8080" in " ".join(s.get("ports", []))]
    assert published == ["proxy"]
    nginx = (COMPOSE / "nginx.conf").read_text()
    upstreams = re.findall(r"^\s*server\s+([\w.-]+):(\d+)", nginx, re.M)
    assert sorted(host for host, _ in upstreams) == sorted(gateways)
    assert "proxy_buffering off" in nginx
    engines = services["engines"]["command"]
    assert engines[:3] == ["sim", "--engines", "4"]
    assert engines[engines.index("--host") + 1] == "0.0.0.0"
    assert "redis" in services


def test_compose_gateway_config_loads_and_names_compose_services(compose: dict[str, Any]):
    services = compose["services"]
    configs = set()
    for name in ("gateway-1", "gateway-2"):
        service = services[name]
        target = service["environment"]["KVGATE_CONFIG"]
        (source,) = [src for src, dst in _bind_sources(service) if dst == target]
        configs.add(source)
    (source,) = configs
    config = load_config(COMPOSE / source)
    assert config.state.backend == "redis"
    assert urlsplit(config.state.url).hostname in services
    ports = {9100 + i for i in range(4)}
    for pool in config.pools:
        for endpoint in pool.endpoints:
            url = urlsplit(endpoint.url)
            assert url.hostname == "engines" and url.port in ports


def test_prometheus_scrapes_every_gateway_and_engine(compose: dict[str, Any]):
    scrape = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {
        target
        for job in scrape["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    expected = {"gateway-1:8080", "gateway-2:8080"} | {f"engines:{9100 + i}" for i in range(4)}
    assert targets == expected
    assert {t.split(":")[0] for t in targets} <= set(compose["services"])


# --- Kubernetes ------------------------------------------------------------------------------


def _kustomizations() -> list[Path]:
    return sorted(KUBE.rglob("kustomization.yaml"))


@pytest.mark.parametrize("path", _kustomizations(), ids=lambda p: str(p.parent.relative_to(KUBE)))
def test_kustomization_references_exist(path: Path):
    kustomization = yaml.safe_load(path.read_text())
    here = path.parent
    for resource in kustomization.get("resources", []):
        target = here / resource
        assert target.is_file() or (target / "kustomization.yaml").is_file(), resource
    for generator in (
        *kustomization.get("configMapGenerator", []),
        *kustomization.get("secretGenerator", []),
    ):
        for file in generator.get("files", []):
            assert (here / file.split("=")[-1]).is_file(), file
    for patch in kustomization.get("patches", []):
        if "path" in patch:
            assert (here / patch["path"]).is_file(), patch["path"]


def _base_objects() -> dict[tuple[str, str], dict[str, Any]]:
    base = KUBE / "base"
    objects = {}
    for resource in yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]:
        for doc in _documents(base / resource):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def _secret_env(secret: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in secret["stringData"].items():
        monkeypatch.setenv(key, value)


def test_configmap_config_and_policies_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    base = KUBE / "base"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    for file in generator["files"]:
        shutil.copy(base / file, tmp_path / Path(file).name)  # a ConfigMap volume is flat
    _secret_env(_base_objects()[("Secret", "kvgate-secrets")], monkeypatch)
    config = load_config(tmp_path / "gateway.yaml")
    assert config.state.backend == "redis"
    assert config.auth is not None and config.auth.tenants
    policies = load_policies(config)
    assert {p.name for p in policies.values()} - {"kvgate"}  # the mounted policy file loads


def test_gateway_deployment_probes_drain_and_runs_unprivileged():
    objects = _base_objects()
    deployment = objects[("Deployment", "kvgate")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] >= 2
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["KVGATE_CONFIG"].startswith(container["volumeMounts"][0]["mountPath"] + "/")
    assert env["KVGATE_HOST"] == "0.0.0.0"
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = int(pre_stop[1]) + GRACEFUL_SHUTDOWN_SECONDS
    assert pod["terminationGracePeriodSeconds"] > drain
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert ("Secret", container["envFrom"][0]["secretRef"]["name"]) in objects
    selector = deployment["spec"]["selector"]["matchLabels"]
    for kind in ("Service", "PodDisruptionBudget", "ServiceMonitor"):
        (obj,) = [
            o for (k, _), o in objects.items() if k == kind and o["metadata"]["name"] == "kvgate"
        ]
        spec = obj["spec"]
        chosen = spec["selector"].get("matchLabels", spec["selector"])
        assert chosen == selector, kind


@pytest.fixture(scope="module")
def rendered_example() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBE / "overlays" / "example")],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_example_overlay_renders_every_piece(rendered_example: list[dict[str, Any]]):
    kinds = {doc["kind"] for doc in rendered_example}
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
        "StatefulSet",
    } <= kinds
    assert all(
        doc["metadata"].get("namespace") == "kvgate"
        for doc in rendered_example
        if doc["kind"] != "Namespace"
    )


def test_example_config_lists_every_engine_the_autoscaler_may_start(
    rendered_example: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in rendered_example:
        by_kind.setdefault(doc["kind"], []).append(doc)
    (configmap,) = by_kind["ConfigMap"]
    (gateway,) = [d for d in by_kind["Deployment"] if d["metadata"]["name"] == "kvgate"]
    volumes = gateway["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": configmap["metadata"]["name"]}} in volumes
    for name, text in configmap["data"].items():
        (tmp_path / name).write_text(text)
    (secret,) = by_kind["Secret"]
    _secret_env(secret, monkeypatch)
    config = load_config(tmp_path / "gateway.yaml")
    statefulsets = {s["metadata"]["name"]: s for s in by_kind["StatefulSet"]}
    max_replicas = {
        hpa["spec"]["scaleTargetRef"]["name"]: hpa["spec"]["maxReplicas"]
        for hpa in by_kind["HorizontalPodAutoscaler"]
    }
    listed: dict[str, set[str]] = {}
    for pool in config.pools:
        for endpoint in pool.endpoints:
            pod, service = urlsplit(endpoint.url).hostname.split(".")[:2]
            assert statefulsets[service]["spec"]["serviceName"] == service
            listed.setdefault(service, set()).add(pod)
    for name, statefulset in statefulsets.items():
        most = max_replicas.get(name, statefulset["spec"]["replicas"])
        assert listed[name] == {f"{name}-{i}" for i in range(most)}, name
