"""Deterministic embeddings: a unit vector derived from a hash of the input text."""

import hashlib
import math
import struct
from typing import Any

from kvgate.sim_tokenizer import count_tokens

from .openai_api import ApiError, resolve_model
from .options import EngineOptions


def embed(text: str, dim: int) -> list[float]:
    """Return a unit-length vector of `dim` floats that depends only on `text` and `dim`."""
    raw = hashlib.shake_256(text.encode()).digest(2 * dim)
    values = [value / 32768.0 - 1.0 for value in struct.unpack(f"<{dim}H", raw)]
    norm = math.sqrt(sum(value * value for value in values)) or 1.0
    return [value / norm for value in values]


def embeddings_response(body: Any, options: EngineOptions) -> dict[str, Any]:
    """Answer a `/v1/embeddings` body; raise ApiError if it is malformed or too long."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = resolve_model(body, options)
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        raise ApiError(400, "input must be a string or a non-empty list of strings", "input")
    token_counts = [count_tokens(text) for text in inputs]
    if max(token_counts) > options.context_length:
        raise ApiError(
            400,
            f"This model's maximum context length is {options.context_length} "
            "tokens. Please reduce the length of the input.",
            "input",
        )
    data = [
        {"object": "embedding", "index": index, "embedding": embed(text, options.embedding_dim)}
        for index, text in enumerate(inputs)
    ]
    total = sum(token_counts)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
