# kvgate image. Builds with `docker build -t kvgate .` or `podman build -t kvgate .`.
#
#   docker run -p 8080:8080 kvgate
#       the demo: a gateway over two embedded simulated engines, at http://localhost:8080/v1
#   docker run -v "$PWD/my-config:/etc/kvgate" -p 8080:8080 kvgate serve --config /etc/kvgate/gateway.yaml
#       production: your config file. Engine URLs in it must be reachable from inside the
#       container: 127.0.0.1 there is the container itself, not the host (use the engines'
#       hostnames, a Compose service name, or host.docker.internal).
#
# KVGATE_CONFIG, KVGATE_HOST, KVGATE_PORT and KVGATE_LOG_LEVEL stand in for the flags of the
# same name (docs/operations.md). The image sets KVGATE_HOST=0.0.0.0 and KVGATE_PORT=8080, so
# both commands listen on 0.0.0.0:8080 and the health check follows `-e KVGATE_PORT=...`.

# --- build: a virtualenv with pinned dependencies, then kvgate itself --------------------------
FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvgate
WORKDIR /src
# Dependencies alone first, from the project's runtime list pinned by constraints.txt: this
# layer is rebuilt only when one of these two files changes, not on every code change.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > runtime.txt \
 && /opt/kvgate/bin/pip install -c constraints.txt -r runtime.txt
COPY README.md LICENSE ./
COPY kvgate ./kvgate
RUN /opt/kvgate/bin/pip install --no-deps . \
 && /opt/kvgate/bin/kvgate --version

# --- runtime: the virtualenv only, run by an unprivileged user --------------------------------
FROM python:3.12-slim
# A fixed numeric id, so Kubernetes' runAsNonRoot can verify it without a user database.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvgate
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVGATE_HOST=0.0.0.0 \
    KVGATE_PORT=8080
USER 10001
EXPOSE 8080
# python, not curl: the slim image has no curl. The port follows KVGATE_PORT.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVGATE_PORT', '8080'), timeout=2)"
ENTRYPOINT ["kvgate"]
CMD ["demo"]
