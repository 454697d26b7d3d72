# Minimal image: `docker build -t kvgate .` then
# `docker run -p 8080:8080 -v $PWD/config:/config kvgate serve --config /config/single-node.yaml`
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvgate ./kvgate
RUN pip install --no-cache-dir . && useradd --system kvgate
USER kvgate
EXPOSE 8080
ENTRYPOINT ["kvgate"]
CMD ["demo", "--host", "0.0.0.0", "--port", "8080"]
