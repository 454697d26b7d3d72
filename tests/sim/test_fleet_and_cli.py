"""Fleet lifecycle, port assignment, the public surface and the CLI."""

import os
import signal
import subprocess
import sys

import httpx

import kvgate.sim
from kvgate.sim import EngineOptions, SimFleet
from tests.servers import free_base_port, port_is_free


def test_public_surface_is_pinned():
    assert kvgate.sim.__all__ == [
        "FAULT_MODES",
        "PROFILES",
        "EngineOptions",
        "Fault",
        "SimEngine",
        "SimFleet",
        "TimingProfile",
    ]


async def test_fleet_uses_consecutive_ports_and_runs_in_a_live_loop():
    base = free_base_port(3)
    async with SimFleet(3, base_port=base, options=EngineOptions(profile="fast")) as fleet:
        assert fleet.urls == [f"http://127.0.0.1:{base + i}" for i in range(3)]
        async with httpx.AsyncClient(timeout=5) as client:
            for url in fleet.urls:
                assert (await client.get(f"{url}/health")).status_code == 200
    assert port_is_free(base)


async def test_fleet_listens_on_the_address_it_is_given():
    # 127.0.0.2 is loopback too on Linux, yet a different address from 127.0.0.1.
    options = EngineOptions(profile="fast")
    async with SimFleet(1, options=options, host="127.0.0.2") as fleet:
        port = fleet.engines[0].port
        assert fleet.urls == [f"http://127.0.0.2:{port}"]
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(f"{fleet.urls[0]}/health")).status_code == 200
            try:
                await client.get(f"http://127.0.0.1:{port}/health")
                raise AssertionError("the engine answered on an address it was not given")
            except httpx.ConnectError:
                pass


def test_in_thread_fleet_serves_blocking_clients_and_clears_faults():
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        assert len(set(fleet.urls)) == 2
        fleet.engines[1].set_fault({"mode": "refuse"})
        with httpx.Client(timeout=5) as client:
            assert client.get(f"{fleet.urls[0]}/health").status_code == 200
        with httpx.Client(timeout=5) as client:
            try:
                client.get(f"{fleet.urls[1]}/health")
                raise AssertionError("a refusing engine answered")
            except httpx.ConnectError:
                pass
        fleet.engines[1].clear_fault()
        with httpx.Client(timeout=5) as client:
            assert client.get(f"{fleet.urls[1]}/health").status_code == 200


def test_cli_prints_one_line_per_engine_and_stops_on_sigint():
    code = (
        "import argparse, sys; from kvgate.sim import cli; p = argparse.ArgumentParser(); "
        "cli.add_arguments(p); sys.exit(cli.run(p.parse_args(sys.argv[1:])))"
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "--engines",
            "2",
            "--base-port",
            "0",
            "--flavor",
            "sglang",
            "--model",
            "m1",
            "m2",
            "--profile",
            "fast",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline().split() for _ in range(2)]
        assert [line[:4] for line in lines] == [["engine", str(i), "sglang", "m1"] for i in (0, 1)]
        with httpx.Client(timeout=5) as client:
            models = client.get(f"{lines[1][4]}/v1/models").json()
        assert [model["id"] for model in models["data"]] == ["m1", "m2"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
