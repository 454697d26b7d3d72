"""benchmarks/pyspy_samples.py reads py-spy's raw samples into parts, kvgate functions and
lines, in both sampling modes `benchmarks/cpu_profile.py` offers (non-stop: Python frames only;
`--native`: C frames below them)."""

from __future__ import annotations

from pathlib import Path

from tests import benchmark_modules

pyspy_samples = benchmark_modules.load("pyspy_samples")

SITE = "/srv/.venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11/asyncio"
ROOT = f"<module> (kvgate/cli.py:338);main (kvgate/cli.py:334);Runner.run ({STDLIB}/runners.py:118)"
LOOP = "run_forever (loop.c:33397)"
TIMEOUT = f"Timeout.reschedule ({STDLIB}/timeouts.py:71)"
CHAIN = (
    "GatewayApp._inference (kvgate/app.py:313);RequestChain.handle (kvgate/chain/pipeline.py:76)"
)

# Non-stop sampling: Python frames only; each innermost frame pays for the C it calls.
NON_STOP = f"""\
{CHAIN};H1Connection.exchange (kvgate/upstream/h1_connection.py:137) 16
{CHAIN};PolicyPicker._choose (kvgate/routing/router.py:150) 4
{CHAIN};Forwarder.__call__ (kvgate/upstream/forwarder.py:80);{TIMEOUT} 2
RequestResponseCycle.send ({SITE}/uvicorn/protocols/http/httptools_impl.py:524) 7
{ROOT} 13
{CHAIN};MutexValue.inc ({SITE}/prometheus_client/values.py:28) 1
"""

# Native sampling: C frames below the Python ones, the idle loop sampled too.
NATIVE = f"""\
{ROOT};{LOOP};uv_run (core.c:464);uv__io_poll (linux.c:1546);epoll_pwait (libc.so.6) 50
{CHAIN};H1Connection.exchange (kvgate/upstream/h1_connection.py:137);__writev (libc.so.6) 9
{ROOT};{LOOP};uv__stream_io (stream.c:1210) 3
{CHAIN};PolicyPicker._choose (kvgate/routing/router.py:150);PyObject_Call (call.c:12) 4
{ROOT};gc_collect_main (gcmodule.c:1200) 1
{ROOT};parser_feed (parser.c:88);llhttp_execute (llhttp.c:10) 2
"""


def profile_of(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    raw = tmp_path / "samples.txt"
    raw.write_text(text)
    return pyspy_samples.Profile(raw)


def test_non_stop_samples_go_to_the_innermost_python_frames_part(tmp_path: Path) -> None:
    profile = profile_of(tmp_path, NON_STOP)
    assert dict(profile.by_part) == {
        "upstream client": 16,
        "kvgate": 4,
        "asyncio, stdlib": 3,
        "uvicorn": 7,
        "uvloop (C)": 13,
    }
    assert set(profile.by_part) <= set(pyspy_samples.PARTS)
    assert dict(profile.by_function) == {
        "H1Connection.exchange (kvgate/upstream/h1_connection.py)": 16,
        "PolicyPicker._choose (kvgate/routing/router.py)": 4,
    }
    assert profile.by_line.most_common(3) == [
        ("H1Connection.exchange (kvgate/upstream/h1_connection.py:137)", 16),
        ("Runner.run (asyncio/runners.py:118)", 13),
        ("RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:524)", 7),
    ]
    assert profile.by_line["Timeout.reschedule (asyncio/timeouts.py:71)"] == 2
    assert profile.by_line["MutexValue.inc (prometheus_client/values.py:28)"] == 1


def test_native_samples_go_to_the_innermost_frame_that_says_whose_work_it_is(
    tmp_path: Path,
) -> None:
    profile = profile_of(tmp_path, NATIVE)
    assert dict(profile.by_part) == {
        "socket writes": 9,
        "uvloop (C)": 3,
        "kvgate": 4,
        "collector": 1,
        "httptools (C)": 2,
    }, "the idle loop (epoll) is no sample of work"
    assert set(profile.by_part) <= set(pyspy_samples.NATIVE_PARTS)
    assert dict(profile.by_function) == {"PolicyPicker._choose (kvgate/routing/router.py)": 4}
    assert profile.by_line["H1Connection.exchange (kvgate/upstream/h1_connection.py:137)"] == 9
