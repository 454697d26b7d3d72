"""How long a request will take once dispatched, per model, learnt from requests that finished.

Two estimates per model, each a moving mean with its mean absolute deviation (as TCP estimates
round-trip times, RFC 6298): time to first token (dispatch → first event) and time per output
token after it. The time to finish a request for `n` output tokens is

    (ttft + K x ttft deviation) + n x (token time + K x token time deviation)

with K = `admission.prediction_deviations`. Admission refuses waiters whose remaining deadline
is shorter than this, so the estimate is deliberately on the slow side: under sustained
overload, earliest-deadline-first serves every deferred request just as its remaining time
reaches the prediction, and with the mean alone about half of them would miss their deadline
(and be cut off by the relay) after an engine had spent the time on them. Before the first
observation the means are the configured initial values and the deviations are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

_MEAN_GAIN = 0.1
_DEVIATION_GAIN = 0.25


@dataclass(slots=True)
class Estimate:
    """A moving mean and mean absolute deviation of one quantity (seconds)."""

    mean: float
    deviation: float = 0.0

    def observe(self, value: float) -> None:
        error = value - self.mean
        self.mean += _MEAN_GAIN * error
        self.deviation += _DEVIATION_GAIN * (abs(error) - self.deviation)

    def upper(self, deviations: float) -> float:
        return self.mean + deviations * self.deviation


class DurationPredictor:
    def __init__(self, initial_ttft: float, initial_token_time: float, deviations: float) -> None:
        self.initial_ttft = initial_ttft
        self.initial_token_time = initial_token_time
        self.deviations = deviations
        self._ttft: dict[str, Estimate] = {}
        self._token_time: dict[str, Estimate] = {}

    def ttft(self, model: str) -> float:
        """The mean time to first token (what a typical request sees)."""
        estimate = self._ttft.get(model)
        return estimate.mean if estimate is not None else self.initial_ttft

    def duration(self, model: str, output_tokens: int) -> float:
        """Seconds from dispatch to the last of `output_tokens`, on the slow side."""
        ttft = self._ttft.get(model)
        token_time = self._token_time.get(model)
        first = ttft.upper(self.deviations) if ttft is not None else self.initial_ttft
        per_token = (
            token_time.upper(self.deviations) if token_time is not None else self.initial_token_time
        )
        return first + output_tokens * per_token

    def observe_ttft(self, model: str, seconds: float) -> None:
        self._estimate(self._ttft, model, self.initial_ttft).observe(max(0.0, seconds))

    def observe_token_time(self, model: str, seconds: float) -> None:
        self._estimate(self._token_time, model, self.initial_token_time).observe(max(0.0, seconds))

    @staticmethod
    def _estimate(table: dict[str, Estimate], model: str, initial: float) -> Estimate:
        estimate = table.get(model)
        if estimate is None:
            estimate = table[model] = Estimate(initial)
        return estimate
