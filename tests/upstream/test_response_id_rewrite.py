"""A Responses answer's ids are relayed in the client's form, whole or streamed, however the
stream's bytes are cut (kvgate/upstream/response_id_rewrite.py)."""

from __future__ import annotations

import orjson
import pytest

from kvgate.routing.response_ids import ResponseIds, client_id
from kvgate.upstream.response_id_rewrite import ResponseIdRewriter

URL = "http://engine-1"
NEW = "resp_4b1e0c5f8d2a4e6b9c7d3f1a2b4c6d8e"
PREVIOUS = "resp_9d8c7b6a5f4e4d3c8b2a1f0e9d8c7b6a"
CLIENT_NEW = client_id(NEW, "acme", URL)
CLIENT_PREVIOUS = client_id(PREVIOUS, "acme", URL)


def response(status: str) -> dict[str, object]:
    return {"id": NEW, "object": "response", "status": status, "previous_response_id": PREVIOUS}


def event(kind: str, **fields: object) -> bytes:
    payload = orjson.dumps({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


STREAM = b"".join(
    [
        event("response.created", response=response("in_progress"), sequence_number=0),
        event("response.output_text.delta", item_id="msg_1", delta="see " + NEW, sequence_number=1),
        event("response.output_text.delta", item_id="msg_1", delta=CLIENT_NEW, sequence_number=2),
        event("response.completed", response=response("completed"), sequence_number=3),
    ]
)
EXPECTED = (
    STREAM.replace(CLIENT_NEW.encode(), b"<kept>")
    .replace(NEW.encode(), CLIENT_NEW.encode())
    .replace(PREVIOUS.encode(), CLIENT_PREVIOUS.encode())
    .replace(b"<kept>", CLIENT_NEW.encode())
)


def test_a_whole_answer_gets_the_clients_ids_and_nothing_else_changes():
    answer = orjson.dumps({**response("completed"), "output": [{"id": "msg_1", "text": "hi"}]})
    rewritten, parsed = ResponseIdRewriter(ResponseIds("acme"), URL).body(answer)
    assert parsed == orjson.loads(answer)  # decoded once: settlement reads its usage there
    assert orjson.loads(rewritten) == {
        **response("completed"),
        "id": CLIENT_NEW,
        "previous_response_id": CLIENT_PREVIOUS,
        "output": [{"id": "msg_1", "text": "hi"}],
    }


@pytest.mark.parametrize("size", [1, 3, 17, 64, 500, len(STREAM)])
def test_a_stream_cut_anywhere_reads_as_if_rewritten_whole(size):
    """After the first event (whole, as the relay's scanner hands events over: it names the
    response), the bytes are cut anywhere: an id, or the mark after one, split between two
    reads is rewritten all the same; an id already in the client's form (echoed text) is left
    as it is."""
    first_end = STREAM.index(b"\n\n") + 2
    rewriter = ResponseIdRewriter(ResponseIds("acme", {PREVIOUS: CLIENT_PREVIOUS}), URL)
    out = [rewriter.events(STREAM[:first_end])]
    rest = STREAM[first_end:]
    out += [rewriter.events(rest[i : i + size]) for i in range(0, len(rest), size)]
    out.append(rewriter.flush())
    assert b"".join(out) == EXPECTED


def test_whole_events_are_never_held_back():
    rewriter = ResponseIdRewriter(ResponseIds("acme"), URL)
    for piece in STREAM.split(b"\n\n")[:-1]:
        out = rewriter.events(piece + b"\n\n")
        assert out.endswith(b"\n\n")
    assert rewriter.flush() == b""


def test_a_stream_is_relayed_as_is_until_an_event_names_the_response():
    rewriter = ResponseIdRewriter(ResponseIds("acme"), URL)
    opening = event("response.output_text.delta", delta="no object yet: " + NEW)
    assert rewriter.events(opening) == opening
    created = event("response.created", response=response("in_progress"))
    assert rewriter.events(created) == created.replace(NEW.encode(), CLIENT_NEW.encode()).replace(
        PREVIOUS.encode(), CLIENT_PREVIOUS.encode()
    )


def test_an_engine_error_names_the_id_the_client_sent():
    rewriter = ResponseIdRewriter(ResponseIds("acme", {PREVIOUS: CLIENT_PREVIOUS}), URL)
    message = f"Response with id '{PREVIOUS}' not found."
    assert rewriter.text(message) == f"Response with id '{CLIENT_PREVIOUS}' not found."
