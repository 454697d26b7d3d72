"""Simulated engines that keep the Responses API's stored responses, for the stored-response
tests (`store_fleet`, a fixture of tests/conftest.py)."""

from __future__ import annotations

from kvgate.sim import SimFleet


def received(fleet: SimFleet) -> list[int]:
    """How many requests each engine of `fleet` has received."""
    return [engine.stats()["requests_received"] for engine in fleet.engines]
