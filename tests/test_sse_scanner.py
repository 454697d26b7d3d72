"""The SSE scanner finds events across arbitrary chunk splits without changing any byte."""

from __future__ import annotations

import pytest

from kvgate.upstream.sse import MAX_EVENT_BYTES, SseProtocolError, SseScanner

STREAM = (
    b'data: {"id":"1","choices":[{"delta":{"content":"a"}}]}\n\n'
    b": keep-alive\n\n"
    b'data: {"id":"1","choices":[{"delta":{"content":"\\"error\\" is a word"}}]}\n\n'
    b'data: {"id":"1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 2, 7, 64, len(STREAM)])
def test_any_chunking_gives_the_same_reading(size):
    scanner = SseScanner()
    for i in range(0, len(STREAM), size):
        scanner.feed(STREAM[i : i + size])
    assert scanner.data_events == 4
    assert scanner.done and scanner.terminated
    assert scanner.error is None
    assert scanner.usage == {"prompt_tokens": 3, "completion_tokens": 2}


def test_comment_alone_is_not_an_event():
    scanner = SseScanner()
    scanner.feed(b": ping\n\n")
    assert scanner.data_events == 0 and not scanner.terminated


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"error": {"message": "boom", "type": "x", "param": null, "code": 500}}\r\n\r\n',
        b'data: {"object": "error", "message": "boom", "code": 500}\n\n',
        b'event: error\ndata: {"type": "error", "code": "server_error", "message": "boom", '
        b'"param": null, "sequence_number": 3}\n\n',
    ],
)
def test_error_events_in_either_shape_terminate(event):
    scanner = SseScanner()
    scanner.feed(event)
    assert scanner.error is not None and scanner.error["message"] == "boom"
    assert scanner.terminated and not scanner.done


def test_content_that_says_error_is_not_an_error():
    scanner = SseScanner()
    scanner.feed(b'data: {"choices":[{"delta":{"content":"error"}}],"x":"error"}\n\n')
    assert scanner.error is None


def test_multiline_and_field_prefixed_events():
    scanner = SseScanner()
    scanner.feed(b"event: message\nid: 3\ndata: [DONE]\n\n")
    assert scanner.done


def test_an_event_with_a_field_after_its_data_is_read_by_its_data_lines():
    scanner = SseScanner()
    scanner.feed(b'data: {"choices":[],"usage":{"total_tokens":3}}\nid: 4\n\n')
    assert scanner.data_events == 1 and scanner.usage == {"total_tokens": 3}


def test_oversized_event_is_a_protocol_error():
    scanner = SseScanner()
    part = b"x" * 2**20
    scanner.feed(b"data: {")
    with pytest.raises(SseProtocolError):
        for _ in range(MAX_EVENT_BYTES // len(part) + 1):
            scanner.feed(part)


@pytest.mark.parametrize("ending", [b"\n\n", b"\r\n\r\n"])
def test_a_large_event_arriving_in_many_reads_is_relayed_whole_once_it_ends(ending):
    event = b'data: {"choices":[{"text":"' + b"y" * 3_000_000 + b'"}]}' + ending
    scanner = SseScanner()
    out = [scanner.feed(event[i : i + 65536]) for i in range(0, len(event), 65536)]
    assert out[-1] == event and not any(out[:-1])
    assert scanner.data_events == 1


def test_an_event_end_spread_over_reads_of_one_byte_is_found_when_it_arrives():
    scanner = SseScanner()
    first, second = b'data: {"choices":[]}', b'data: {"choices":[1]}'
    out = [scanner.feed(part) for part in (first, b"\r", b"\n", b"\r", b"\n" + second)]
    assert out == [b"", b"", b"", b"", first + b"\r\n\r\n"]
    assert scanner.data_events == 1


@pytest.mark.parametrize("split", [1, 5, 40, 10_000])
def test_an_error_event_and_what_follows_it_are_held_back(split):
    content = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    error = (
        b'data: {"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}\n\n'
    )
    stream = content * 2 + error + content + b"data: [DONE]\n\n"
    scanner = SseScanner()
    relayed = b"".join(scanner.feed(stream[i : i + split]) for i in range(0, len(stream), split))
    assert relayed == content * 2
    assert scanner.error is not None and scanner.error["code"] == 400
    assert scanner.terminated and not scanner.done and scanner.flush() == b""


def test_a_responses_stream_ends_with_its_last_event_and_carries_usage():
    scanner = SseScanner()
    scanner.feed(
        b'event: response.created\ndata: {"type":"response.created","response":{"error":null}}\n\n'
        b"event: response.output_text.delta\n"
        b'data: {"type":"response.output_text.delta","delta":"\\"response.completed\\""}\n\n'
    )
    assert not scanner.terminated  # a delta that only mentions the name ends nothing
    scanner.feed(
        b"event: response.completed\n"
        b'data: {"type":"response.completed","response":{"usage":{"total_tokens":9}}}\n\n'
    )
    assert scanner.done and scanner.error is None
    assert scanner.usage == {"total_tokens": 9}


# Where `usage` may appear in an event, and what the scanner makes of it: read only when it is
# a key with a value other than null; every event is relayed byte for byte unless stripped.
USAGE_EVENTS = [
    # vLLM with `include_usage`: every content chunk carries a null usage.
    (b'{"choices":[{"delta":{"content":"a"}}],"usage":null}', None),
    (b'{"choices":[{"delta":{"content":"a"}}],"usage" : null}', None),
    # A word in the content (escaped quotes) or a string value, not a key.
    (b'{"choices":[{"delta":{"content":"the \\"usage\\": {} field"}}]}', None),
    (b'{"choices":[{"delta":{"content":"x"}}],"type":"usage"}', None),
    # The usage of the last content chunk, and of a usage-only chunk, with or without spaces.
    (b'{"choices":[{"delta":{}}],"usage":{"prompt_tokens":3}}', {"prompt_tokens": 3}),
    (b'{"choices":[],"usage" :\t{"prompt_tokens":4}}', {"prompt_tokens": 4}),
]


@pytest.mark.parametrize(("data", "usage"), USAGE_EVENTS)
def test_usage_is_read_only_where_it_is_a_value(data, usage):
    event = b"data: " + data + b"\n\n"
    scanner = SseScanner()
    assert scanner.feed(event) == event
    assert scanner.usage == usage
    assert scanner.data_events == 1 and scanner.error is None and not scanner.terminated


def test_a_usage_only_event_is_stripped_for_a_client_that_did_not_ask_and_the_rest_kept():
    content = b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
    usage_only = b'data: {"choices":[],"usage":{"prompt_tokens":5}}\n\n'
    scanner = SseScanner(strip_usage=True)
    assert scanner.feed(content + usage_only + b"data: [DONE]\n\n") == (
        content + b"data: [DONE]\n\n"
    )
    assert scanner.usage == {"prompt_tokens": 5} and scanner.done


def test_usage_on_a_content_event_is_taken_out_of_that_event_only():
    """Some OpenAI-compatible servers put the usage on the last content event: a client that
    did not ask for usage gets that event without it (its JSON re-serialised), the rest as
    sent; one that asked gets every byte as sent."""
    first = b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n'
    last = (
        b'id: 7\r\ndata: {"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}],'
        b'"usage": {"prompt_tokens": 5, "completion_tokens": 2}}\r\n\r\n'
    )
    stream = first + last + b"data: [DONE]\r\n\r\n"
    stripped = SseScanner(strip_usage=True)
    assert stripped.feed(stream) == first + (
        b'id: 7\r\ndata: {"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}]}\r\n\r\n'
        b"data: [DONE]\r\n\r\n"
    )
    assert stripped.usage == {"prompt_tokens": 5, "completion_tokens": 2}
    assert stripped.data_events == 3
    kept = SseScanner()
    assert kept.feed(stream) == stream and kept.usage == stripped.usage
