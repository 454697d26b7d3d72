"""How well kvgate's cost model predicts a request's time to first token, from the
`x-kvgate-route-explain` header of every request of a run (`routing.py --cost-model`).

The picker prices each candidate in prefill tokens; the part of that price that is the
request's own wait is `base_tokens` + its uncached prompt tokens + the prefill tokens queued
ahead of it + `decode_token_weight` x decoding sequences (the miss pricing on top is what the
choice costs others, not this request's wait). A least-squares line TTFT = a + b x tokens over
the run gives the engine's effective step and per-token costs; the relative errors around it
say which differences in predicted cost the model can resolve at all. kvgate's `hold_margin`
(a prompt stays with the endpoint holding most of it unless moving saves more than that) is
taken from the median m of these errors: a move compares two predictions, so it must save
more than (1 + m) / (1 - m) (kvgate/routing/pickers.py). `placed_away` counts the requests
the picker sent away from the candidate its index saw holding most of their prompt, and the
prompt tokens that gave up: the part of the prefix hit a router's own placements lose,
beside what its index got wrong. `kept_behind_queue` counts the requests placed behind a
queue while a candidate had none, and the hit that kept.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

BASE_TOKENS = 150.0  # predicted_ttft's defaults (kvgate/routing/scorers.py)
DECODE_TOKEN_WEIGHT = 2.0


@dataclass(slots=True)
class Explained:
    explain: str  # the x-kvgate-route-explain header
    endpoint: str
    ttft: float
    prompt_tokens: int  # the engine's count, to rescale the gateway's estimate


def _candidates(explain: str) -> tuple[int, dict[str, dict[str, str]]]:
    """The gateway's prompt-token estimate and every candidate's fields, by endpoint name."""
    prompt = 0
    candidates: dict[str, dict[str, str]] = {}
    for part in explain.split("; "):
        if part.startswith("prompt_tokens="):
            prompt = int(part.split("=", 1)[1])
        else:
            name, *items = part.split(" ")
            if items and "=" not in name:
                candidates[name] = dict(item.split("=", 1) for item in items)
    return prompt, candidates


def _fields(explain: str, endpoint: str) -> tuple[int, dict[str, str]]:
    """The gateway's prompt-token estimate and the chosen candidate's fields."""
    prompt, candidates = _candidates(explain)
    return prompt, candidates.get(endpoint, {})


def own_wait_tokens(record: Explained) -> float | None:
    """The request's own predicted wait in prefill tokens, in the engine's tokens."""
    estimate, chosen = _fields(record.explain, record.endpoint)
    if not estimate or not chosen:
        return None
    scale = record.prompt_tokens / estimate
    return (
        BASE_TOKENS
        + scale * (float(chosen["uncached"]) + float(chosen["queued_tokens"]))
        + DECODE_TOKEN_WEIGHT * float(chosen["decoding"])
    )


def fit(records: list[Explained]) -> dict[str, float]:
    """Step and per-token cost of the least-squares line, its R², and the relative errors'
    median and 75th percentile; {} with fewer than 10 usable records."""
    pairs = [(own_wait_tokens(r), r.ttft) for r in records]
    points = [(x, y) for x, y in pairs if x is not None]
    if len(points) < 10:
        return {}
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    step = mean_y - slope * mean_x
    predicted = [step + slope * x for x in xs]
    residual = sum((y - p) ** 2 for y, p in zip(ys, predicted, strict=True))
    total = sum((y - mean_y) ** 2 for y in ys)
    errors = sorted(abs(y - p) / p for y, p in zip(ys, predicted, strict=True) if p > 0)
    return {
        "step_s": step,
        "token_s": slope,
        "r2": 1 - residual / total if total else 0.0,
        "error_p50": errors[len(errors) // 2],
        "error_p75": errors[int(0.75 * len(errors))],
    }


def _explained(
    records: list[Explained], field: str
) -> Iterator[tuple[Explained, int, dict[str, dict[str, str]], dict[str, str]]]:
    """Each record whose explanation gives a prompt estimate and, for the chosen candidate,
    `field`: (record, estimate, every candidate's fields, the chosen one's)."""
    for record in records:
        estimate, candidates = _candidates(record.explain)
        chosen = candidates.get(record.endpoint)
        if estimate and chosen is not None and field in chosen:
            yield record, estimate, candidates, chosen


def placed_away(records: list[Explained]) -> tuple[int, int, float]:
    """Requests placed on an endpoint predicted to hold less of their prompt than another
    candidate did, out of the explained ones, and the prompt tokens those placements gave up
    (the chosen endpoint's uncached tokens above the fewest any candidate had) as a share of
    all prompt tokens: where a router's prefix hit falls short of what its own index saw."""
    moved = explained = 0
    given_up = prompt = 0.0
    for record, estimate, candidates, chosen in _explained(records, "uncached"):
        explained += 1
        prompt += record.prompt_tokens
        fewest = min(int(fields["uncached"]) for fields in candidates.values())
        extra = int(chosen["uncached"]) - fewest
        if extra > 0:
            moved += 1
            given_up += extra * record.prompt_tokens / estimate
    return moved, explained, given_up / prompt if prompt else 0.0


def kept_behind_queue(records: list[Explained]) -> tuple[int, int, float]:
    """Requests placed behind queued prefill while another candidate had none queued, out of
    the explained ones, and the median prompt tokens of hit such a placement kept (the fewest
    uncached tokens among the candidates with no queue, minus the chosen one's): what a
    request waited for, as its router saw it. NaN median when there were none."""
    kept: list[float] = []
    explained = 0
    for record, estimate, candidates, chosen in _explained(records, "queued_tokens"):
        explained += 1
        idle = [f for f in candidates.values() if float(f["queued_tokens"]) == 0]
        if idle and float(chosen["queued_tokens"]) > 0:
            fewest_idle = min(int(f["uncached"]) for f in idle)
            kept.append((fewest_idle - int(chosen["uncached"])) * record.prompt_tokens / estimate)
    return len(kept), explained, statistics.median(kept) if kept else math.nan


def describe(stats: dict[str, float]) -> str:
    if not stats:
        return "cost model: too few explained requests"
    return (
        f"cost model: TTFT ≈ {stats['step_s'] * 1e3:.1f} ms + {stats['token_s'] * 1e6:.1f} µs"
        f" x tokens (R² {stats['r2']:.2f}), relative error p50 {stats['error_p50']:.0%},"
        f" p75 {stats['error_p75']:.0%}"
    )
