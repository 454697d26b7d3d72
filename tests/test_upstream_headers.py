from __future__ import annotations

from kvgate.request_options import request_id_from
from kvgate.upstream.headers import upstream_headers


def test_request_id_kept_when_sane_and_generated_otherwise():
    assert request_id_from([(b"x-request-id", b"req-1.a:b")]) == "req-1.a:b"
    generated = request_id_from([(b"x-request-id", b"bad id\n")])
    assert generated != "bad id\n" and len(generated) == 32
    assert request_id_from([]) != request_id_from([])


def test_forwarded_set():
    out = dict(
        upstream_headers(
            [
                (b"host", b"gw"),
                (b"content-length", b"10"),
                (b"connection", b"close, X-Hop"),
                (b"x-hop", b"1"),
                (b"te", b"trailers"),
                (b"authorization", b"Bearer client"),
                (b"x-kvgate-priority", b"0"),
                (b"traceparent", b"00-abc"),
                (b"user-agent", b"sdk"),
                (b"accept-encoding", b"gzip"),
                (b"content-type", b"application/x-www-form-urlencoded"),
            ],
            "rid",
            b"Bearer engine",
        )
    )
    assert out == {
        b"traceparent": b"00-abc",
        b"user-agent": b"sdk",
        b"x-request-id": b"rid",
        b"accept-encoding": b"identity",
        b"content-type": b"application/json",
        b"authorization": b"Bearer engine",
    }
