"""Command-line settings: the version, the KVGATE_* environment, bind defaults, help texts."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

import kvgate
from kvgate.cli import DEFAULT_HOST, build_parser
from tests.test_cli import _free_port, _stop, _wait_ready

KVGATE = [sys.executable, "-m", "kvgate.cli"]
SETTINGS_ENV = ("KVGATE_CONFIG", "KVGATE_HOST", "KVGATE_PORT", "KVGATE_LOG_LEVEL")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _env_without_settings(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS_ENV}
    return {**env, **extra}


def test_version_has_one_source():
    out = subprocess.run([*KVGATE, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"kvgate {kvgate.__version__}"
    assert version("kvgate") == kvgate.__version__


def test_serve_and_demo_share_one_default_bind_address(clean_env: pytest.MonkeyPatch):
    assert DEFAULT_HOST == "127.0.0.1"
    demo = build_parser().parse_args(["demo"])
    assert (demo.host, demo.port, demo.log_level) == (DEFAULT_HOST, 8080, "info")
    serve = build_parser().parse_args(["serve", "--config", "x.yaml"])
    # None: serve takes server.host / server.port from the config file.
    assert (serve.host, serve.port) == (None, None)
    for command in ("serve", "demo"):
        help_text = subprocess.run(
            [*KVGATE, command, "--help"],
            capture_output=True,
            text=True,
            check=True,
            env=_env_without_settings(COLUMNS="200"),
        ).stdout
        assert f"Listens on {DEFAULT_HOST} unless told otherwise" in help_text


def test_environment_supplies_serve_and_demo_settings(clean_env: pytest.MonkeyPatch):
    clean_env.setenv("KVGATE_CONFIG", "/etc/kvgate/gateway.yaml")
    clean_env.setenv("KVGATE_HOST", "0.0.0.0")
    clean_env.setenv("KVGATE_PORT", "9123")
    clean_env.setenv("KVGATE_LOG_LEVEL", "WARNING")
    serve = build_parser().parse_args(["serve"])
    assert serve.config == Path("/etc/kvgate/gateway.yaml")
    assert (serve.host, serve.port, serve.log_level) == ("0.0.0.0", 9123, "warning")
    demo = build_parser().parse_args(["demo"])
    assert (demo.host, demo.port, demo.log_level) == ("0.0.0.0", 9123, "warning")
    flags = build_parser().parse_args(["serve", "--config", "a.yaml", "--port", "1"])
    assert (flags.config, flags.port) == (Path("a.yaml"), 1)


def test_bad_environment_values_are_usage_errors():
    for name, value, reason in (
        ("KVGATE_PORT", "http", "--port: http is not a port (an integer from 0 to 65535)"),
        ("KVGATE_LOG_LEVEL", "loud", "invalid log level 'loud'"),
    ):
        result = subprocess.run(
            [*KVGATE, "demo"],
            capture_output=True,
            text=True,
            env=_env_without_settings(**{name: value}),
            timeout=30,
        )
        assert result.returncode == 2, result.stderr
        assert reason in result.stderr
    missing = subprocess.run(
        [*KVGATE, "serve"], capture_output=True, text=True, env=_env_without_settings()
    )
    assert missing.returncode == 2
    assert "--config" in missing.stderr


@pytest.mark.timeout(90)
def test_serve_runs_from_the_environment_alone(tmp_path: Path):
    from kvgate.sim import EngineOptions, SimFleet

    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast")) as fleet:
        port = _free_port()
        config = tmp_path / "gateway.yaml"
        # server.port names a port the environment overrides.
        config.write_text(
            f"server:\n  port: 1\npools:\n  - name: default\n    models: [sim-model]\n"
            f"    endpoints:\n      - url: {fleet.urls[0]}\n"
        )
        env = _env_without_settings(
            KVGATE_CONFIG=str(config),
            KVGATE_HOST="127.0.0.1",
            KVGATE_PORT=str(port),
            KVGATE_LOG_LEVEL="warning",
        )
        proc = subprocess.Popen(
            [*KVGATE, "serve"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(base, proc)
            assert httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"] == "sim-model"
        finally:
            _stop(proc)


def test_sim_help_shows_every_default():
    help_text = subprocess.run(
        [*KVGATE, "sim", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env=_env_without_settings(COLUMNS="200"),
    ).stdout
    text = " ".join(help_text.split())
    for shown in ("(default: 1)", "(default: 9100)", "(default: vllm)", "(default: realistic)"):
        assert shown in text
    options = {word.rstrip(",") for word in text.split() if word.startswith("--")} - {"--help"}
    assert len(options) == 18, options
    assert text.count("(default: ") == len(options)
