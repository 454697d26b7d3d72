"""What an operator can expose: `server.admin_port` moves /metrics and /admin/* to a listener of
their own (404 on the public port), `server.models_require_key` puts /v1/models behind a key;
and `GET /v1/models/{id}` answers as OpenAI does (the SDK's `models.retrieve`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
import yaml

from kvgate.cli import admin_listener_config, main, serve_with_admin
from kvgate.hot_reload import ReloadableGateway
from kvgate.sim import EngineOptions, SimFleet
from tests.chain.helpers import chat, make_key, tenant
from tests.conftest import gateway_config
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread
from tests.upstreams import ScriptedUpstream

KEY, KEY_ENTRY = make_key("acme-1")
NARROW, NARROW_ENTRY = make_key("narrow-1")


class TwoListeners:
    """The gateway served as `kvgate serve` does with `server.admin_port`: the public and the
    admin server on one event loop (`serve_with_admin`), in a thread."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        path.write_text(yaml.safe_dump(config))
        self.app = ReloadableGateway(path)
        self.public = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
        )
        admin = admin_listener_config(self.app, "127.0.0.1", 0, "warning", "text")
        self.admin = uvicorn.Server(admin)
        self._thread = threading.Thread(
            target=lambda: asyncio.run(serve_with_admin(self.public, self.admin)), daemon=True
        )

    @staticmethod
    def _url(server: uvicorn.Server) -> str:
        return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    def __enter__(self) -> tuple[str, str]:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not (self.public.started and self.admin.started):
            assert self._thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        return self._url(self.public), self._url(self.admin)

    def __exit__(self, *exc: object) -> None:
        self.public.should_exit = True
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


@pytest.fixture
def listeners(upstream, tmp_path) -> Iterator[tuple[str, str]]:
    config = gateway_config(
        [upstream[1].url], pool={"models": ["m1"]}, server={"admin_port": 0}, auth="none"
    )
    with TwoListeners(config, tmp_path / "gateway.yaml") as urls:
        yield urls


def test_admin_port_serves_metrics_and_admin_routes_and_the_public_port_does_not(listeners):
    public, admin = listeners
    assert chat(public, None).status_code == 200
    for path in ("/metrics", "/admin/admission", "/admin/reload"):
        hidden = httpx.post(public + path)
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "unknown_url"
    metrics = httpx.get(admin + "/metrics")
    assert metrics.status_code == 200
    assert "kvgate_requests_total{" in metrics.text and 'status="200"' in metrics.text
    assert httpx.get(admin + "/admin/admission").json()["open_reservations"] == {
        "requests": 0,
        "tokens": 0,
    }
    assert httpx.get(admin + "/v1/models").status_code == 404  # inference stays public
    assert httpx.post(admin + "/metrics").status_code == 405
    assert httpx.get(public + "/v1/models").status_code == 200
    reloaded = httpx.post(admin + "/admin/reload", timeout=10)
    assert (reloaded.status_code, reloaded.json()) == (200, {"status": "reloaded"})
    assert chat(public, None).status_code == 200


def test_without_admin_port_metrics_stay_on_the_public_port(gateway):
    _, server = gateway
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_admin_port_needs_one_worker(tmp_path: Path, capsys):
    config = gateway_config(
        ["http://127.0.0.1:9"],
        server={"admin_port": 9999},
        state={"backend": "redis", "url": "redis://127.0.0.1:1"},
    )
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["serve", "--config", str(path), "--workers", "2"]) == 1
    assert "admin_port needs one worker" in capsys.readouterr().err


def test_models_retrieve_answers_like_openai(gateway):
    _, server = gateway
    client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    model = client.models.retrieve("m1")
    assert (model.id, model.object, model.owned_by) == ("m1", "model", "kvgate")
    assert isinstance(model.created, int)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    assert missing.value.body["type"] == "invalid_request_error"
    assert [m.id for m in client.models.list()] == ["m1"]


def test_models_say_the_context_length_that_fits_every_engine_serving_them(start_gateway):
    """vLLM's model list carries `max_model_len`, `root` and `parent`; clients budget their
    context with it. Two engines of one model with different context lengths: the smaller."""
    long, short = (EngineOptions(profile="fast", max_model_len=n) for n in (32768, 8192))
    with (
        SimFleet.in_thread(engines=1, options=long) as a,
        SimFleet.in_thread(engines=1, options=short) as b,
    ):
        _, server = start_gateway(gateway_config([*a.urls, *b.urls], auth="none"))
        client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.retrieve("sim-model")
        assert model.model_extra == {"max_model_len": 8192, "root": "sim-model"}
        [listed] = client.models.list().data
        assert listed.model_extra == model.model_extra


def test_models_require_key(start_gateway):
    engine = ScriptedUpstream(("m1", "other-1"))
    with ServerThread(engine) as engine_server:
        _models_require_key(start_gateway, engine_server.url)


def _models_require_key(start_gateway, url):
    _, server = start_gateway(
        gateway_config(
            [url],
            pool={"models": ["m1", "other-1"]},
            server={"models_require_key": True},
            auth={
                "tenants": [
                    tenant("acme", "gold", [KEY_ENTRY]),
                    tenant("narrow", "bronze", [NARROW_ENTRY], models=["other-*"]),
                ]
            },
        )
    )
    anonymous = httpx.get(server.url + "/v1/models")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] is None
    assert httpx.get(server.url + "/v1/models/m1").status_code == 401
    full = sdk_client(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert sorted(m.id for m in full.models.list()) == ["m1", "other-1"]
    narrow = sdk_client(base_url=server.url + "/v1", api_key=NARROW, max_retries=0)
    assert [m.id for m in narrow.models.list()] == ["other-1"]
    with pytest.raises(openai.NotFoundError):
        narrow.models.retrieve("m1")


def test_models_are_open_by_default_even_with_keys(upstream, start_gateway):
    _, server = start_gateway(
        gateway_config(
            [upstream[1].url],
            pool={"models": ["m1"]},
            auth={"tenants": [tenant("acme", "gold", [KEY_ENTRY])]},
        )
    )
    assert httpx.get(server.url + "/v1/models").status_code == 200
