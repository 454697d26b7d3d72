"""The one place filters, scorers and pickers are registered under their config names."""

from __future__ import annotations

from typing import Any

from kvgate.routing import filters, pickers, scorers

FILTERS: dict[str, Any] = {
    cls.NAME: cls
    for cls in (
        filters.ServesModel,
        filters.Healthy,
        filters.BreakerAdmits,
        filters.FreshTelemetry,
        filters.NotSaturated,
        filters.Jurisdiction,
        filters.Labels,
    )
}
SCORERS: dict[str, Any] = {
    cls.NAME: cls
    for cls in (
        scorers.PrefixMatchScorer,
        scorers.QueueDepthScorer,
        scorers.KvUsageScorer,
        scorers.InflightScorer,
        scorers.PredictedTtftScorer,
        scorers.EndpointCostScorer,
        scorers.SessionAffinityScorer,
    )
}
PICKERS: dict[str, Any] = {
    cls.NAME: cls
    for cls in (
        pickers.RandomPicker,
        pickers.RoundRobinPicker,
        pickers.LeastLoadedPicker,
        pickers.MaxScorePicker,
    )
}
# Scorers that read `ctx.prefix`: a policy using one makes the picker compute it.
PREFIX_SCORERS = frozenset({"prefix_match", "predicted_ttft", "session_affinity"})
