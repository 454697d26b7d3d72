"""Where requests wait for capacity: per model, one queue per latency class, weighted fair
between tenants of a class, earliest deadline first within a tenant.

    AdmissionQueue
      (model, jurisdictions) → class (interactive, standard, batch; strictly in that order)
        tenant → heap of waiters by (latest start, arrival)

Within a tenant and class, the waiter that should start first goes first: the earlier of its
deadline and its arrival plus its predicted prefill time (uncached prompt tokens at the fleet's
prefill rate), minus any workflow boost. With the classes' long deadlines that is shortest
prefill first, which lowers mean time to first token, with aging: a long prefill waits at most
its own prefill time longer than it would in arrival order, so none starves; a tight deadline
(the client's `x-kvgate-deadline`) still goes first.

Between the tenants of one class, start-time fair queuing: each tenant has a virtual time that
advances by 1 / weight per request served; the backlogged tenant with the smallest virtual time
goes next, and a tenant that was idle restarts at the class's virtual clock (no saved credit).
Removal (disconnect, timeout, shed) is lazy: the waiter is marked and skipped when reached;
counts are exact at once. This module only orders; `admission.py` decides when to dequeue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvgate.chain.intent import CLASSES_BY_RANK
from kvgate.chain.tenants import Tenant
from kvgate.types import RequestContext

_sequence = itertools.count()

# Requests wait per (model, allowed jurisdictions, pinned endpoint): the endpoints that could
# serve them. A Responses continuation can run only on the endpoint storing its conversation
# (`RequestContext.pinned`, named here); other requests have None there.
QueueKey = tuple[str, frozenset[str] | None, str | None]


@dataclass(eq=False)
class Waiter:
    """One queued request. `future` resolves with None when it may run, or with the error that
    refuses it. `order`: lower goes first within its tenant."""

    ctx: RequestContext
    tenant: Tenant
    key: QueueKey
    rank: int
    deadline: float
    boost: float
    enqueued: float
    future: asyncio.Future[None]
    # Predicted prefill seconds (0: order by deadline alone).
    prefill: float = 0.0
    seq: int = field(default_factory=lambda: next(_sequence))
    live: bool = True
    granted: bool = False
    resumed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def order(self) -> tuple[float, int]:
        """The latest time it should start (see the module docstring), then arrival."""
        start_by = self.deadline
        if self.prefill:
            start_by = min(start_by, self.enqueued + self.prefill)
        return (start_by - self.boost, self.seq)

    def shed_order(self) -> tuple[int, int, float, int]:
        """Larger is shed first: worst class, then lowest tier, then latest deadline, newest."""
        return (self.rank, self.tenant.tier_priority, self.deadline - self.boost, self.seq)


@dataclass
class _TenantQueue:
    tenant: Tenant
    heap: list[tuple[tuple[float, int], Waiter]] = field(default_factory=list)
    live: int = 0
    vtime: float = 0.0


@dataclass
class _ClassQueue:
    tenants: dict[str, _TenantQueue] = field(default_factory=dict)
    live: int = 0
    vclock: float = 0.0


class AdmissionQueue:
    def __init__(self) -> None:
        self._keys: dict[QueueKey, list[_ClassQueue]] = {}
        self._count = 0
        self._by_class = [0] * len(CLASSES_BY_RANK)

    def __len__(self) -> int:
        return self._count

    def length(self, rank: int) -> int:
        return self._by_class[rank]

    def waiting_keys(self) -> list[QueueKey]:
        return [m for m, classes in self._keys.items() if any(c.live for c in classes)]

    def waiting_at_or_above(
        self, key: QueueKey, rank: int, eligible: Callable[[Tenant], bool]
    ) -> bool:
        """Whether a request of class `rank` or better waits under `key` for capacity (not
        only for its own tenant's concurrency cap, which must not hold up other tenants)."""
        classes = self._keys.get(key)
        if classes is None:
            return False
        return any(
            tenant_queue.live and eligible(tenant_queue.tenant)
            for queue in classes[: rank + 1]
            if queue.live
            for tenant_queue in queue.tenants.values()
        )

    def push(self, waiter: Waiter) -> None:
        classes = self._keys.setdefault(waiter.key, [_ClassQueue() for _ in CLASSES_BY_RANK])
        queue = classes[waiter.rank]
        tenant_queue = queue.tenants.get(waiter.tenant.name)
        if tenant_queue is None:
            tenant_queue = queue.tenants[waiter.tenant.name] = _TenantQueue(waiter.tenant)
        if tenant_queue.live == 0:
            tenant_queue.vtime = max(tenant_queue.vtime, queue.vclock)
        heapq.heappush(tenant_queue.heap, (waiter.order, waiter))
        tenant_queue.live += 1
        queue.live += 1
        self._by_class[waiter.rank] += 1
        self._count += 1

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out (it stays in its heap until reached, or until removed waiters
        outnumber live ones there). False if already out."""
        if not waiter.live:
            return False
        waiter.live = False
        queue = self._keys[waiter.key][waiter.rank]
        tenant_queue = queue.tenants[waiter.tenant.name]
        tenant_queue.live -= 1
        _compact(tenant_queue)
        queue.live -= 1
        self._by_class[waiter.rank] -= 1
        self._count -= 1
        return True

    def pop_next(
        self, key: QueueKey, ranks: range, eligible: Callable[[Tenant], bool]
    ) -> Waiter | None:
        """The next waiter under `key` among classes `ranks` (best first) whose tenant is
        `eligible` (e.g. below its concurrency cap), removed from the queue; None if none."""
        classes = self._keys.get(key)
        if classes is None:
            return None
        for rank in ranks:
            queue = classes[rank]
            if not queue.live:
                continue
            best: _TenantQueue | None = None
            for tenant_queue in queue.tenants.values():
                if not tenant_queue.live or (best is not None and tenant_queue.vtime >= best.vtime):
                    continue
                head = _head(tenant_queue)
                if head is not None and eligible(head.tenant):
                    best = tenant_queue
            if best is None:
                continue
            waiter = _head(best)
            assert waiter is not None
            heapq.heappop(best.heap)
            queue.vclock = best.vtime
            best.vtime += 1.0 / waiter.tenant.weight
            self.remove(waiter)
            return waiter
        return None

    def shed_candidate(self) -> Waiter | None:
        """The waiter to drop first when the queues are full (see `Waiter.shed_order`)."""
        worst: Waiter | None = None
        for waiter in self._live():
            if worst is None or waiter.shed_order() > worst.shed_order():
                worst = waiter
        return worst

    def waiters(self) -> list[Waiter]:
        """Every waiter still in the queue."""
        return list(self._live())

    def _live(self) -> Iterator[Waiter]:
        for classes in self._keys.values():
            for queue in classes:
                if not queue.live:
                    continue
                for tenant_queue in queue.tenants.values():
                    yield from (w for _, w in tenant_queue.heap if w.live)


def _compact(tenant_queue: _TenantQueue) -> None:
    """Drop removed waiters from the heap once they are more than half of it: a waiter that
    timed out or disconnected holds its request's body, and those must not pile up behind a
    long-waiting head. Amortised constant time per removal."""
    heap = tenant_queue.heap
    if len(heap) > 2 * tenant_queue.live + 8:
        heap[:] = [entry for entry in heap if entry[1].live]
        heapq.heapify(heap)


def _head(tenant_queue: _TenantQueue) -> Waiter | None:
    """The tenant's first live waiter, dropping removed ones from the top of its heap."""
    heap = tenant_queue.heap
    while heap and not heap[0][1].live:
        heapq.heappop(heap)
    return heap[0][1] if heap else None
