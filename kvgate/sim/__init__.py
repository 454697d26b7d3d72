"""Simulated vLLM- and SGLang-faithful inference engines that run on a CPU.

The public surface is pinned by tests/sim/test_exported_members.py.
"""

from .engine_server import SimEngine
from .faults import FAULT_MODES, Fault
from .fleet import SimFleet
from .options import PROFILES, EngineOptions, TimingProfile

__all__ = [
    "FAULT_MODES",
    "PROFILES",
    "EngineOptions",
    "Fault",
    "SimEngine",
    "SimFleet",
    "TimingProfile",
]
