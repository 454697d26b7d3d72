"""One endpoint's load as one routing decision sees it (`Endpoint.load`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.routing.endpoints import Endpoint


class EndpointLoad:
    """One endpoint's load as one routing decision sees it: derived once per endpoint per
    decision (`Endpoint.load`), then only read, so every filter, scorer and picker sees the same
    numbers and a decision checks telemetry freshness once per endpoint.

    The gateway's own accounting (this process, plus peer replicas' shared load) is corrected
    upwards by fresh telemetry for work the gateway did not send:

    - `waiting`: the engine's waiting count from fresh telemetry, carried forward by the
      streams this process sent there and saw leave the queue since the scrape (0 without)
    - `queued_requests`: requests waiting for their first token (own count or `waiting`)
    - `queued_tokens`: prompt tokens still to prefill, own and peers', plus the engine's waiting
      requests beyond those times the endpoint's mean prompt length
    - `active_sequences`: decoding sequences (own count or engine's running)
    - `kv_usage`: the engine's KV use, 0 without fresh telemetry
    - `total_inflight`: requests in flight here from this process and its peers
    - `requests`: `max(total_inflight, queued_requests + active_sequences)`, what pickers balance
    """

    __slots__ = (
        "active_sequences",
        "endpoint",
        "inflight",
        "kv_usage",
        "name",
        "queued_requests",
        "queued_tokens",
        "requests",
        "stale",
        "telemetry",
        "total_inflight",
        "waiting",
    )

    def __init__(self, endpoint: Endpoint, now: float) -> None:
        # Hot path (once per candidate per decision): plain comparisons, no builtin calls.
        telemetry = endpoint.fresh_telemetry_at(now)
        inflight = endpoint.inflight
        peers = endpoint.peer_inflight
        prefill = float(endpoint.prefill_requests)
        queued_tokens = float(endpoint.prefill_tokens + endpoint.peer_queued_tokens)
        active = float(endpoint.decoding)
        if telemetry is None:
            queued = prefill
            waiting = 0.0
            kv_usage = 0.0
        else:
            # The scraped waiting count, carried forward by the streams that joined and left
            # the queue since: telemetry is up to a scrape interval old, a burst is not.
            waiting = telemetry.waiting + (
                (endpoint.streams_queued - endpoint.queued_at_scrape)
                - (endpoint.streams_unqueued - endpoint.unqueued_at_scrape)
            )
            if waiting < 0.0:
                waiting = 0.0
            queued = waiting if waiting > prefill else prefill
            known = prefill + peers  # peers' queued work is counted already
            if waiting > known:
                queued_tokens += (waiting - known) * endpoint.mean_prompt_tokens
            running = telemetry.running
            if running > active:
                active = running
            kv_usage = telemetry.kv_usage
        total = inflight + peers
        self.endpoint = endpoint
        self.name = endpoint.name
        self.telemetry = telemetry
        self.stale = telemetry is None and endpoint.scraped
        self.inflight = inflight
        self.total_inflight = total
        self.waiting = waiting
        self.queued_requests = queued
        self.queued_tokens = queued_tokens
        self.active_sequences = active
        self.kv_usage = kv_usage
        busy = queued + active
        self.requests = busy if busy > total else float(total)

    def saturated_by(self, max_waiting: float, max_kv_usage: float) -> bool:
        """The in-flight cap is reached, or with fresh telemetry more than `max_waiting`
        requests wait (`waiting`) or KV use is above `max_kv_usage`. Pure."""
        cap = self.endpoint.max_inflight
        if cap is not None and self.total_inflight >= cap:
            return True
        return self.telemetry is not None and (
            self.waiting > max_waiting or self.kv_usage > max_kv_usage
        )
