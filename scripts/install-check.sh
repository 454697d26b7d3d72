#!/usr/bin/env bash
# The container image's install steps, without a container engine: copy what the Dockerfile
# copies into a scratch directory, install the runtime dependencies from pyproject.toml pinned
# by constraints.txt into a fresh virtualenv, then kvgate alone; then, from outside the
# repository, run `kvgate demo` and check /healthz as the image's HEALTHCHECK does.
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
KVGATE_PORT=$port "$work/venv/bin/kvgate" demo --log-level warning > "$work/demo.log" 2>&1 &
demo=$!
for _ in $(seq 100); do
    if KVGATE_PORT=$port "$work/venv/bin/python" -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['KVGATE_PORT'], timeout=1)" 2>/dev/null; then
        echo "install-check: the installed wheel serves /healthz (run from $work, outside $repo)"
        exit 0
    fi
    sleep 0.2
done
cat "$work/demo.log" >&2
echo "install-check: kvgate demo did not answer /healthz" >&2
exit 1
