"""The command line as users run it: real subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.sdk_clients import sdk_client

KVGATE = [sys.executable, "-m", "kvgate.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, _stop(proc).decode()
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("kvgate did not become ready")


def _stop(proc: subprocess.Popen[bytes]) -> bytes:
    """Terminate, collect the output and close the pipes."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or b""


def test_version_and_help():
    out = subprocess.run([*KVGATE, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("kvgate ")
    for command in ("serve", "demo", "sim", "check-config", "policies"):
        help_text = subprocess.run(
            [*KVGATE, command, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert f"kvgate {command}" in help_text


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["serve", "--config", "x.yaml", "--port", "99999"], "--port: 99999 is not a port"),
        (["serve", "--config", "x.yaml", "--workers", "0"], "--workers: must be an integer of"),
        (["demo", "--port", "-5"], "--port: -5 is not a port"),
        (["sim", "--engines", "zero"], "--engines: must be an integer of at least 1"),
        (["sim", "--base-port", "65000", "--kv-events"], "up to port 67000, past 65535"),
        (["keys", "new", "--tenant", " "], "--tenant needs the tenant's name"),
    ],
)
def test_out_of_range_flags_are_usage_errors(args, said):
    out = subprocess.run([*KVGATE, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode in (1, 2) and said in out.stderr and "Traceback" not in out.stderr
    assert not out.stdout


def test_check_config_names_the_broken_key(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "server:\n  port: eighty\npools:\n  - name: a\n    endpoints:\n"
        "      - url: http://h:1\n        weight: 3\n"
    )
    result = subprocess.run([*KVGATE, "check-config", str(bad)], capture_output=True, text=True)
    assert result.returncode == 1
    assert f"{bad}: line 2, column 3: server.port:" in result.stderr
    assert "(got 'eighty')" in result.stderr
    assert f"{bad}: line 7, column 9: pools[0].endpoints[0].weight: unknown key" in result.stderr
    good = subprocess.run(
        [*KVGATE, "check-config", "config/demo.yaml"], capture_output=True, text=True
    )
    assert good.returncode == 0, good.stderr


def test_serve_without_a_config_says_both_ways_to_give_one():
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_CONFIG"}
    out = subprocess.run([*KVGATE, "serve"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert "serve needs a config file: --config FILE, or set KVGATE_CONFIG" in out.stderr


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("OTEL_TRACES_SAMPLER_ARG", "2", "$OTEL_TRACES_SAMPLER_ARG: must be a number from 0 to 1"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "unsupported trace exporter 'zipkin'"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "unsupported OTLP protocol 'http/json'"),
    ],
)
def test_check_config_refuses_the_tracing_environment_serve_would(tmp_path, variable, value, said):
    config = tmp_path / "gw.yaml"
    config.write_text("pools:\n  - name: a\n    endpoints: [{url: 'http://h:1'}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_TRACES_EXPORTER": "otlp", variable: value}
    for command in (["check-config", str(config)], ["serve", "--config", str(config)]):
        out = subprocess.run(
            [*KVGATE, *command], capture_output=True, text=True, env=env, timeout=60
        )
        assert out.returncode == 1 and said in out.stderr, (command, out.stderr)


def test_serve_rejects_a_broken_config_without_starting(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: []\n")
    result = subprocess.run(
        [*KVGATE, "serve", "--config", str(bad)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert "pools" in result.stderr


def test_the_admin_port_must_not_be_the_served_port(tmp_path: Path):
    """check-config refuses it (serve then failed with a bare bind error), and so does serve
    when `--port` makes them one."""
    config = tmp_path / "ports.yaml"
    pools = "pools:\n  - name: a\n    endpoints: [{url: 'http://h:1'}]\n"
    config.write_text("server: {port: 19390, admin_port: 19390}\n" + pools)
    checked = subprocess.run([*KVGATE, "check-config", str(config)], capture_output=True, text=True)
    assert checked.returncode == 1
    assert "admin_port 19390 is the port requests are served on" in checked.stderr
    config.write_text("server: {port: 19391, admin_port: 19390}\n" + pools)
    served = subprocess.run(
        [*KVGATE, "serve", "--config", str(config), "--port", "19390"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert served.returncode == 1
    assert "port 19390 is server.admin_port too" in served.stderr


@pytest.mark.timeout(90)
def test_demo_streams_a_chat_completion_to_the_openai_sdk():
    port = _free_port()
    proc = subprocess.Popen(
        [*KVGATE, "demo", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        client = sdk_client(base_url=base + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="sim-model",
            stream=True,
            max_tokens=12,
            messages=[{"role": "user", "content": "Tell me about KV caches."}],
        )
        contents = [c.choices[0].delta.content for c in stream if c.choices]
        assert len([c for c in contents if c]) >= 5
        assert [m.id for m in client.models.list()] == ["sim-model"]
    finally:
        output = _stop(proc)
    assert b"base_url=" in output


@pytest.mark.timeout(90)
def test_serve_runs_the_minimal_config_against_simulated_engines(tmp_path: Path):
    from kvgate.sim import EngineOptions, SimFleet

    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        port = _free_port()
        config = tmp_path / "kvgate.yaml"
        endpoints = "".join(f"      - url: {u}\n" for u in fleet.urls)
        config.write_text(
            f"server:\n  port: {port}\npools:\n  - name: default\n"
            f"    engine: vllm\n    models: [sim-model]\n    endpoints:\n"
            f"{endpoints}"
        )
        proc = subprocess.Popen(
            [
                *KVGATE,
                "serve",
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_ready(base, proc)
            client = sdk_client(base_url=base + "/v1", api_key="unused", max_retries=0)
            seen = set()
            for _ in range(20):  # ties between idle engines are broken at random
                raw = client.chat.completions.with_raw_response.create(
                    model="sim-model", max_tokens=4, messages=[{"role": "user", "content": "hello"}]
                )
                seen.add(raw.headers["x-kvgate-endpoint"])
                assert raw.parse().choices[0].message.content
            assert seen == {"default-0", "default-1"}
            assert httpx.get(base + "/readyz").status_code == 200
        finally:
            _stop(proc)


def test_policies_list_and_show_the_shipped_policies():
    listed = subprocess.run([*KVGATE, "policies", "list"], capture_output=True, text=True)
    assert listed.returncode == 0
    names = [line.split("\t")[0] for line in listed.stdout.splitlines()]
    assert names == ["kvgate", "random", "round_robin", "least_loaded", "balanced", "cost",
                     "latency"]  # fmt: skip
    shown = subprocess.run([*KVGATE, "policies", "show", "cost"], capture_output=True, text=True)
    assert shown.returncode == 0 and "name: cost" in shown.stdout
    missing = subprocess.run([*KVGATE, "policies", "show", "nope"], capture_output=True, text=True)
    assert missing.returncode == 1 and "no shipped policy 'nope'" in missing.stderr


def test_check_config_reports_policy_problems(tmp_path: Path):
    config = tmp_path / "gw.yaml"
    config.write_text(
        "pools:\n  - name: a\n    policy: fastest\n    endpoints: [{url: 'http://h:1'}]\n"
    )
    result = subprocess.run([*KVGATE, "check-config", str(config)], capture_output=True, text=True)
    assert result.returncode == 1
    assert f"{config}: pools[0].policy: unknown policy 'fastest'" in result.stderr
    # A problem across sections (a duplicate endpoint) hides none of the policies' problems.
    config.write_text(
        "pools:\n  - name: a\n    policy: fastest\n"
        "    endpoints: [{url: 'http://h:1'}, {url: 'http://h:1'}]\n"
    )
    result = subprocess.run([*KVGATE, "check-config", str(config)], capture_output=True, text=True)
    assert "pools[0].endpoints[1].url: duplicate endpoint" in result.stderr
    assert f"{config}: pools[0].policy: unknown policy 'fastest'" in result.stderr
    assert f"{config}: 2 problem(s)" in result.stderr


def test_serve_closes_connections_whose_headers_trickle(tmp_path: Path):
    """uvicorn alone never times a request's headers; kvgate serve closes the connection after
    `server.header_timeout` while other clients are served."""
    port = _free_port()
    config = tmp_path / "gw.yaml"
    config.write_text(
        f"server: {{port: {port}, header_timeout: 1}}\n"
        "auth: none\npools:\n  - name: p\n    endpoints: [{url: 'http://127.0.0.1:9'}]\n"
    )
    proc = subprocess.Popen(
        [*KVGATE, "serve", "--config", str(config), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        slow = socket.create_connection(("127.0.0.1", port))
        slow.settimeout(10)
        started = time.monotonic()
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for byte in b"X-Slow: " + b"a" * 40:
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            assert httpx.get(url + "/healthz", timeout=2).status_code == 200  # others served
            if time.monotonic() - started > 1.5:
                closed = slow.recv(1) == b""
                break
        assert closed, "the trickling connection was not closed"
        slow.close()
    finally:
        _stop(proc)
