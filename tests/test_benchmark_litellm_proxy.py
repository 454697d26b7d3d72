"""The overhead benchmark's LiteLLM column (benchmarks/litellm_proxy.py): the config it gives
LiteLLM's proxy routes the benchmark's model to the upstream as a vLLM server, and a machine
without LiteLLM gets the reason, not a crash."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests import benchmark_modules

for _sibling in ("services", "peer_router"):  # what litellm_proxy imports
    benchmark_modules.load(_sibling)
litellm_proxy = benchmark_modules.load("litellm_proxy")


def test_the_config_routes_the_model_to_the_upstream_as_a_vllm_server():
    config = yaml.safe_load(litellm_proxy.config("http://127.0.0.1:9", "bench-model"))
    [entry] = config["model_list"]
    assert entry["model_name"] == "bench-model"
    assert entry["litellm_params"]["model"] == "hosted_vllm/bench-model"
    assert entry["litellm_params"]["api_base"] == "http://127.0.0.1:9/v1"
    assert config["general_settings"] == {"dangerously_permit_weak_or_unset_master_key": True}


def test_without_litellm_the_column_is_refused_with_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(litellm_proxy, "DEFAULT_EXECUTABLE", tmp_path / "absent" / "litellm")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert litellm_proxy.executable() is None
    assert litellm_proxy.executable(Path(tmp_path / "nope")) is None
    with (
        pytest.raises(litellm_proxy.PeerUnavailable, match="venv-litellm"),
        litellm_proxy.running_proxy("http://127.0.0.1:9", "bench-model", tmp_path),
    ):
        pass
