"""`/sim/kv-events/faults`: event-stream fault injection over HTTP (engines with KV events).

GET    -> {"fault", "next_seq", "url", "replay_url", "batches_published", "batches_dropped"}
POST   {"mode": "drop", "from_seq": a, "to_seq": b, "replay": true} | {"mode": "stop"}
       | {"mode": "restart"}
DELETE -> clears `drop` / `stop`
"""

from collections.abc import Awaitable, Callable

import orjson

from .asgi_types import Receive, Scope, Send
from .engine_core import EngineCore
from .http_io import read_body, respond
from .kv_event_publisher import KvEventFault, KvEventPublisher

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
PATH = "/sim/kv-events/faults"


def kv_event_fault_routes(
    core: EngineCore, publisher: KvEventPublisher
) -> dict[tuple[str, str], Handler]:
    """The three routes of `PATH`, keyed as the engine app's route table is."""

    async def describe(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, orjson.dumps(publisher.describe()))

    async def set_fault(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            fault = KvEventFault.from_json(orjson.loads(await read_body(receive)))
        except (ValueError, orjson.JSONDecodeError) as error:
            await respond(send, 400, orjson.dumps({"error": {"message": str(error)}}))
            return
        core.set_kv_event_fault(fault)
        await respond(send, 200, orjson.dumps(publisher.describe()))

    async def clear_fault(scope: Scope, receive: Receive, send: Send) -> None:
        core.set_kv_event_fault(None)
        await respond(send, 200, orjson.dumps(publisher.describe()))

    return {("GET", PATH): describe, ("POST", PATH): set_fault, ("DELETE", PATH): clear_fault}
