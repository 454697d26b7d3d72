"""Injected faults: what an engine should do wrong, for how many requests, how often.

`refuse` is a listener-level state (the engine's port refuses TCP connections until the
fault is cleared) and `hang_health` an engine-level one (its health route never answers while
inference keeps working); `probability` and `count` do not apply to them. Every other mode is drawn
per inference request (`POST /v1/...`): with `probability` p (seeded RNG) and, when `count`
is given, for the next `count` requests it fires on, after which the fault clears itself.
"""

import random
from dataclasses import asdict, dataclass
from typing import Any

REFUSE = "refuse"
HANG_HEALTH = "hang_health"
# Modes that are a state of the engine until cleared, never drawn per inference request.
STATE_MODES = (REFUSE, HANG_HEALTH)
FAULT_MODES = (
    REFUSE,
    HANG_HEALTH,
    "reset_before_first_byte",
    "crash_after_tokens",
    "http_error",
    "slow_first_token",
    "stall_after_tokens",
    "malformed_sse",
    "hang",
)


@dataclass(frozen=True)
class Fault:
    """One fault spec; unused fields are ignored by modes that do not need them."""

    mode: str
    tokens: int = 0
    status: int = 503
    retry_after: int | None = None
    delay_ms: int = 0
    probability: float = 1.0
    count: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {self.mode!r}; one of {', '.join(FAULT_MODES)}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError("probability must be within [0, 1]")
        if self.count is not None and self.count < 1:
            raise ValueError("count must be >= 1")
        if self.tokens < 0 or self.delay_ms < 0:
            raise ValueError("tokens and delay_ms must be >= 0")
        if not 100 <= self.status <= 599:
            raise ValueError("status must be an HTTP status code")

    @classmethod
    def from_json(cls, spec: Any) -> "Fault":
        """Build a fault from a JSON object such as `{"mode": "hang"}`; ValueError if invalid."""
        if not isinstance(spec, dict) or "mode" not in spec:
            raise ValueError('a fault is a JSON object with a "mode"')
        unknown = set(spec) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown fault fields: {', '.join(sorted(unknown))}")
        try:
            return cls(**spec)
        except TypeError as error:
            raise ValueError(str(error)) from None

    def as_json(self) -> dict[str, Any]:
        """The fault as the JSON object `from_json` accepts."""
        return asdict(self)


class FaultInjector:
    """Holds the current fault of one engine and draws it for each request."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._fault: Fault | None = None
        self._remaining: int | None = None

    @property
    def current(self) -> Fault | None:
        """The fault in force, if any."""
        return self._fault

    @property
    def health_hangs(self) -> bool:
        """Whether the health route should hang (`hang_health` is in force)."""
        return self._fault is not None and self._fault.mode == HANG_HEALTH

    @property
    def remaining(self) -> int | None:
        """How many more requests the current fault applies to (None: unlimited)."""
        return self._remaining

    def set(self, fault: Fault) -> None:
        """Replace the current fault."""
        self._fault = fault
        self._remaining = fault.count

    def clear(self) -> None:
        """Remove the current fault."""
        self._fault = None
        self._remaining = None

    def draw(self) -> Fault | None:
        """Return the fault to apply to the request now arriving, or None."""
        fault = self._fault
        if fault is None or fault.mode in STATE_MODES:
            return None
        if fault.probability < 1.0 and self._rng.random() >= fault.probability:
            return None
        if self._remaining is not None:
            self._remaining -= 1
            if self._remaining == 0:
                self.clear()
        return fault
