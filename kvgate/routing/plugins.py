"""The one place filters, scorers and pickers are registered under their config names.

A plugin is a class with a `NAME`, a `Params` model pre-filled with its defaults and a plain
constructor taking those params; new behaviour is a new plugin and a line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from kvgate.routing import filters, pickers, scorers
from kvgate.routing.filters import Filter
from kvgate.routing.pickers import Picker
from kvgate.routing.scorers import Scorer

__all__ = ["FILTERS", "PICKERS", "PREFIX_SCORERS", "SCORERS", "Filter", "Picker", "Scorer"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PluginType(Generic[T]):
    """A registered plugin class: its config name, its params model and its constructor."""

    name: str
    params: type[BaseModel]
    build: Any  # the class: build(params) -> T

    def create(self, params: BaseModel) -> T:
        plugin: T = self.build(params)
        return plugin


def _registry(*classes: Any) -> dict[str, PluginType[Any]]:
    return {cls.NAME: PluginType(cls.NAME, cls.Params, cls) for cls in classes}


FILTERS: dict[str, PluginType[Filter]] = _registry(
    filters.FreshTelemetry, filters.NotSaturated, filters.Jurisdiction, filters.Labels
)
SCORERS: dict[str, PluginType[Scorer]] = _registry(
    scorers.PrefixMatchScorer,
    scorers.QueueDepthScorer,
    scorers.KvUsageScorer,
    scorers.InflightScorer,
    scorers.PredictedTtftScorer,
    scorers.EndpointCostScorer,
    scorers.SessionAffinityScorer,
)
PICKERS: dict[str, PluginType[Picker]] = _registry(
    pickers.RandomPicker,
    pickers.RoundRobinPicker,
    pickers.LeastLoadedPicker,
    pickers.MaxScorePicker,
)
# Scorers that read `ctx.prefix`: a policy using one makes the picker compute it.
PREFIX_SCORERS = frozenset({"prefix_match", "predicted_ttft", "session_affinity"})
