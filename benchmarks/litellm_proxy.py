"""The LiteLLM column: LiteLLM's proxy (PyPI `litellm[proxy]`) in front of one upstream.

LiteLLM pins versions of packages kvgate also uses, so it lives in a virtualenv of its own,
`.venv-litellm` at the repository's root (`make .venv-litellm`); `--litellm PATH` names another
`litellm` executable. Launched as its documentation launches it, `litellm --config FILE`, one
worker (`--num_workers 1`, as kvgate's column runs one), binding 127.0.0.1 on a free port. The
config routes the benchmark's model to the upstream as a vLLM server (`hosted_vllm/`), and
starts without a master key (`dangerously_permit_weak_or_unset_master_key`: the load
generators send no key, and kvgate's column runs without auth too). It logs at `ERROR`, to a
file whose tail is shown if it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
from peer_router import PeerUnavailable, wait_until_ready
from services import BENCH_DIR, free_port, stop

NAME = "LiteLLM proxy"
DEFAULT_EXECUTABLE = BENCH_DIR.parent / ".venv-litellm" / "bin" / "litellm"
READY_SECONDS = 90.0  # it imports for 10-20 s on this machine


def executable(given: Path | None = None) -> Path | None:
    """The `litellm` to run: `given`, else the repository's `.venv-litellm`, else one on PATH."""
    if given is not None:
        return given if given.exists() else None
    if DEFAULT_EXECUTABLE.exists():
        return DEFAULT_EXECUTABLE
    found = shutil.which("litellm")
    return Path(found) if found else None


def version(litellm: Path) -> str:
    """The installed LiteLLM's version, from the virtualenv the executable belongs to."""
    python = litellm.parent / "python"
    try:
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown version"
    return out.stdout.strip()


def config(upstream_url: str, model: str) -> str:
    return (
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: hosted_vllm/{model}\n"
        f"      api_base: {upstream_url}/v1\n"
        "      api_key: none\n"
        "general_settings:\n"
        "  dangerously_permit_weak_or_unset_master_key: true\n"
    )


def _alive(base: str) -> bool:
    try:
        return httpx.get(base + "/health/liveliness", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def running_proxy(
    upstream_url: str, model: str, workdir: Path, litellm: Path | None = None
) -> Iterator[tuple[str, int]]:
    """LiteLLM's proxy over `upstream_url` until the block exits; yields its base URL and its
    process id once it answers. Raises PeerUnavailable if it is not installed or cannot
    start."""
    found = executable(litellm)
    if found is None:
        raise PeerUnavailable(
            "`litellm[proxy]` not installed (`make .venv-litellm`, or --litellm PATH)"
        )
    port = free_port()
    settings = workdir / "litellm.yaml"
    settings.write_text(config(upstream_url, model))
    log = workdir / "litellm.log"
    command = [
        str(found),
        "--config",
        str(settings),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]
    env = {**os.environ, "LITELLM_LOG": "ERROR"}
    with log.open("w") as sink:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, cwd=workdir, env=env
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(proc, lambda: _alive(base), log, "litellm", READY_SECONDS)
        yield base, proc.pid
    finally:
        stop(proc)
