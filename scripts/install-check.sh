#!/usr/bin/env bash
# The container image's install steps, without a container engine: copy what the Dockerfile
# copies into a scratch directory, install the runtime dependencies from pyproject.toml pinned
# by constraints.txt into a fresh virtualenv, then kvgate alone; then, from outside the
# repository, run `kvgate demo` and check /healthz as the image's HEALTHCHECK does, then
# `kvgate serve` a config that names a shipped routing policy (`policy: latency`).
# `make test` runs it after the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
demo=""
cleanup() {
    if [ -n "$demo" ]; then kill "$demo" 2>/dev/null || true; wait "$demo" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

mkdir "$work/src"
cp -R pyproject.toml constraints.txt README.md LICENSE kvgate "$work/src/"
cd "$work/src"
"$PYTHON" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q --disable-pip-version-check)
"$work/venv/bin/python" -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > runtime.txt
"${pip[@]}" -c constraints.txt -r runtime.txt
"${pip[@]}" --no-deps .

cd "$work"
"$work/venv/bin/kvgate" --version
port=$("$work/venv/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
healthz() {  # wait until the gateway on port $1 answers /healthz
    for _ in $(seq 100); do
        if "$work/venv/bin/python" -c "import sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % sys.argv[1], timeout=1)" "$1" 2>/dev/null; then
            return 0
        fi
        sleep 0.2
    done
    return 1
}

serving() {  # start "$3..." in the background (log $1), and fail unless it answers /healthz
    local log=$1 what=$2
    shift 2
    "$@" > "$log" 2>&1 &
    demo=$!
    if ! healthz "$port"; then
        cat "$log" >&2
        echo "install-check: $what did not answer /healthz" >&2
        exit 1
    fi
}

serving "$work/demo.log" "kvgate demo" env KVGATE_PORT="$port" "$work/venv/bin/kvgate" demo --log-level warning
echo "install-check: the installed wheel serves /healthz (run from $work, outside $repo)"
kill "$demo"; wait "$demo" 2>/dev/null || true; demo=""

# A config naming a shipped policy by name: the policies are package data, found outside the
# repository.
cat > "$work/gateway.yaml" <<YAML
server: {port: $port}
pools:
  - name: chat
    models: [sim-model]
    policy: latency
    endpoints: [{url: "http://127.0.0.1:9"}]
YAML
"$work/venv/bin/kvgate" check-config "$work/gateway.yaml"
serving "$work/serve.log" "kvgate serve with 'policy: latency'" \
    "$work/venv/bin/kvgate" serve --config "$work/gateway.yaml" --log-level warning
echo "install-check: the installed wheel serves a config with 'policy: latency'"
