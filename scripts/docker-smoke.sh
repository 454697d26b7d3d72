#!/usr/bin/env bash
# Build the image, run its default command (the demo), check its health, stream one chat
# completion through the OpenAI SDK, stop. For machines with Docker or Podman:
#
#   scripts/docker-smoke.sh                 # docker if installed, else podman
#   ENGINE=podman PORT=18081 scripts/docker-smoke.sh
#
# The client side needs the `openai` package: `make test` installs it into .venv (the default
# PYTHON); any Python with openai works.
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${ENGINE:-$(command -v docker >/dev/null 2>&1 && echo docker || echo podman)}
IMAGE=${IMAGE:-kvgate:smoke}
PORT=${PORT:-18080}
PYTHON=${PYTHON:-.venv/bin/python}
command -v "$ENGINE" >/dev/null 2>&1 || { echo "docker-smoke: neither docker nor podman found" >&2; exit 1; }
"$PYTHON" -c "import openai" 2>/dev/null || { echo "docker-smoke: $PYTHON has no openai package (run make test)" >&2; exit 1; }

build_flags=()
# Podman writes OCI images by default, and the OCI format has no HEALTHCHECK.
[ "$(basename "$ENGINE")" = podman ] && build_flags+=(--format docker)
"$ENGINE" build ${build_flags[@]+"${build_flags[@]}"} -t "$IMAGE" .

container=$("$ENGINE" run -d --rm -p "127.0.0.1:$PORT:8080" "$IMAGE")
trap '"$ENGINE" stop "$container" >/dev/null' EXIT

echo "docker-smoke: waiting for the container's health check"
healthy=""
for _ in $(seq 60); do
    if [ "$(basename "$ENGINE")" = podman ]; then
        # Podman runs health checks from systemd timers, absent on many hosts: run it here.
        "$ENGINE" healthcheck run "$container" >/dev/null 2>&1 && healthy=yes
    else
        status=$("$ENGINE" inspect --format '{{.State.Health.Status}}' "$container")
        [ "$status" = healthy ] && healthy=yes
    fi
    [ -n "$healthy" ] && break
    sleep 1
done
[ -n "$healthy" ] || { "$ENGINE" logs "$container" >&2; echo "docker-smoke: never healthy" >&2; exit 1; }

"$PYTHON" - "$PORT" <<'PY'
import sys

from openai import OpenAI

with OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused", max_retries=0) as client:
    stream = client.chat.completions.create(
        model="sim-model",
        stream=True,
        max_tokens=16,
        messages=[{"role": "user", "content": "Tell me about KV caches."}],
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
assert text, "the stream carried no text"
print(f"docker-smoke: streamed {text!r}")
PY
echo "docker-smoke: passed"
