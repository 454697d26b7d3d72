"""Asking an engine's replay socket (ZMQ ROUTER) for the batches it still holds.

vLLM's protocol, which the simulator implements too: a DEALER sends
`[b"", start_seq as 8 big-endian bytes]`; the ROUTER answers `[b"", seq, payload]` for every
buffered batch with `seq >= start_seq`, oldest first, then `[b"", -1 (8 signed bytes), b""]`.
"""

import asyncio

import zmq
import zmq.asyncio

from .decode import KvEventDecodeError

_END_OF_REPLAY = -1


async def fetch_replay(
    context: zmq.asyncio.Context, url: str, start_seq: int, answer_within: float
) -> list[tuple[int, bytes]] | None:
    """The `(seq, payload)` pairs the replay socket at `url` holds from `start_seq` on, in
    the order sent; None if no complete answer came within `answer_within` seconds.

    Raises `KvEventDecodeError` on an answer that breaks the protocol.
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
        batches: list[tuple[int, bytes]] = []
        async with asyncio.timeout(answer_within):
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                    raise KvEventDecodeError("replay answer is not [b'', seq, payload]")
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END_OF_REPLAY:
                    return batches
                batches.append((seq, frames[2]))
    except TimeoutError:
        return None
    finally:
        sock.close(linger=0)
