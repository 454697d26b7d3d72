"""Histogram buckets shared by the gateway's latency metrics, in seconds."""

# 5 ms to 5 min, with edges at 0.5, 1, 2 and 5 s (a 2 s TTFT objective reads off one bucket).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
# Gateway time before the upstream request: sub-millisecond when nothing waits, up to the
# longest admission wait when the fleet is saturated.
TO_UPSTREAM_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60,
)  # fmt: skip
