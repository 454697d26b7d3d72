"""The engine's own JSON APIs beside OpenAI's, as vLLM serves them: `/tokenize`, `/detokenize`,
rerank (`/v1/rerank`, `/rerank`, `/v2/rerank`), score (`/v1/score`, `/score`), `/classify` and
`/pooling`. One JSON object in, one out, in vLLM's shapes; the numbers are deterministic
functions of the text (the simulator runs no model), and the token ids are the simulator
tokenizer's, the ids its engines see.

The simulator has no vocabulary: a token id is the CRC-32 of the token's text. `/detokenize`
knows the ids any engine of the process has handed out from `/tokenize` (they serve one model,
so one vocabulary; what a client detokenizes is what it tokenized), up to `VOCABULARY_LIMIT`
distinct tokens, and answers 400 for any other.
"""

import math
import uuid
from collections.abc import Callable
from typing import Any

from kvgate.sim_chat_template import TemplateError, render_chat
from kvgate.sim_tokenizer import count_tokens, token_ids, tokenize

from .embeddings import embed
from .openai_api import ApiError, now_seconds, resolve_model
from .options import EngineOptions

VOCABULARY_LIMIT = 1_000_000
CLASS_LABELS = ("negative", "positive")


class Vocabulary:
    """The text of every token id `/tokenize` answered with (bounded by `VOCABULARY_LIMIT`)."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._texts)

    def learn(self, tokens: list[str], ids: list[int]) -> None:
        room = VOCABULARY_LIMIT - len(self._texts)
        if room <= 0:
            return
        for token, token_id in zip(tokens, ids, strict=True):
            if token_id not in self._texts and room > 0:
                self._texts[token_id] = token
                room -= 1

    def text(self, ids: list[int]) -> str:
        pieces = []
        for token_id in ids:
            piece = self._texts.get(token_id)
            if piece is None:
                raise ApiError(
                    400,
                    f"token id {token_id} is not in the simulator's vocabulary (it knows the "
                    "ids its engines' /tokenize answered with)",
                    "tokens",
                )
            pieces.append(piece)
        return "".join(pieces)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _fits(texts: list[str], options: EngineOptions, param: str) -> list[int]:
    """Each text's token count; 400 when one is longer than the context."""
    counts = [count_tokens(text) for text in texts]
    if counts and max(counts) > options.context_length:
        raise ApiError(
            400,
            f"This model's maximum context length is {options.context_length} tokens. "
            "Please reduce the length of the input.",
            param,
        )
    return counts


def _strings(value: Any, param: str) -> list[str]:
    """A string or a non-empty list of strings (or of `{"text": ...}` documents), as a list."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        texts = [v.get("text") if isinstance(v, dict) else v for v in value]
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) == len(texts):
            return strings
    raise ApiError(400, f"{param} must be a string or a non-empty list of strings", param)


def _relevance(query: str, document: str, options: EngineOptions) -> float:
    """A score in (0, 1): the logistic of a scaled cosine of the two texts' embeddings."""
    dim = options.embedding_dim
    cosine = sum(a * b for a, b in zip(embed(query, dim), embed(document, dim), strict=True))
    return 1.0 / (1.0 + math.exp(-8.0 * cosine))


def tokenize_response(body: Any, options: EngineOptions, vocabulary: Vocabulary) -> dict:
    """`/tokenize`: a `prompt`, or chat `messages` rendered with the engine's template."""
    body = _object(body)
    resolve_model(body, options)
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            raise ApiError(400, "messages must be a list", "messages")
        try:
            text = render_chat(
                messages,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
            )
        except TemplateError as error:
            raise ApiError(400, str(error), "messages") from None
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ApiError(400, "prompt must be a string", "prompt")
    tokens = tokenize(text)
    ids = token_ids(tokens)
    vocabulary.learn(tokens, ids)
    return {
        "count": len(ids),
        "max_model_len": options.context_length,
        "tokens": ids,
        "token_strs": tokens if body.get("return_token_strs") else None,
    }


def detokenize_response(body: Any, options: EngineOptions, vocabulary: Vocabulary) -> dict:
    """`/detokenize`: the text of token ids this engine's `/tokenize` gave out."""
    body = _object(body)
    resolve_model(body, options)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ApiError(400, "tokens must be a list of integers", "tokens")
    return {"prompt": vocabulary.text(ids)}


def rerank_response(body: Any, options: EngineOptions, vocabulary: Vocabulary) -> dict:
    """Rerank: `documents` by relevance to `query`, most relevant first, the first `top_n`
    (all when 0 or absent)."""
    body = _object(body)
    model = resolve_model(body, options)
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError(400, "query must be a string", "query")
    documents = _strings(body.get("documents"), "documents")
    top_n = body.get("top_n") or 0
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise ApiError(400, "top_n must be a non-negative integer", "top_n")
    counts = _fits([query + document for document in documents], options, "documents")
    scores = [_relevance(query, document, options) for document in documents]
    ranked = sorted(range(len(documents)), key=lambda index: -scores[index])
    results = [
        {"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]}
        for i in ranked
    ]
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"total_tokens": sum(counts)},
        "results": results[:top_n] if top_n else results,
    }


def score_response(body: Any, options: EngineOptions, vocabulary: Vocabulary) -> dict:
    """Score: each pair of `text_1` and `text_2` (one `text_1` goes with every `text_2`)."""
    body = _object(body)
    model = resolve_model(body, options)
    firsts = _strings(body.get("text_1"), "text_1")
    seconds = _strings(body.get("text_2"), "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ApiError(400, "text_1 and text_2 must have the same length", "text_1")
    counts = _fits([a + b for a, b in zip(firsts, seconds, strict=True)], options, "text_2")
    data = [
        {"index": index, "object": "score", "score": _relevance(a, b, options)}
        for index, (a, b) in enumerate(zip(firsts, seconds, strict=True))
    ]
    return _listed("score", model, data, sum(counts))


def _inputs(body: Any, options: EngineOptions) -> tuple[str, list[str], int]:
    """The model a pooling-style body names, its `input` texts and their tokens in all."""
    body = _object(body)
    model = resolve_model(body, options)
    inputs = _strings(body.get("input"), "input")
    return model, inputs, sum(_fits(inputs, options, "input"))


def classify_response(body: Any, options: EngineOptions, vocabulary: Vocabulary) -> dict:
    """Classify: each `input` into `CLASS_LABELS`, with their probabilities."""
    model, inputs, tokens = _inputs(body, options)
    data = []
    for index, text in enumerate(inputs):
        positive = _relevance(text, CLASS_LABELS[1], options)
        probs = [1.0 - positive, positive]
        label = CLASS_LABELS[probs.index(max(probs))]
        data.append(
            {"index": index, "label": label, "probs": probs, "num_classes": len(CLASS_LABELS)}
        )
    return _listed("classify", model, data, tokens)


def pooling_response(body: Any, options: EngineOptions, vocabulary: Vocabulary) -> dict:
    """Pooling: each `input`'s pooled hidden state (here its embedding)."""
    model, inputs, tokens = _inputs(body, options)
    data = [
        {"index": index, "object": "pooling", "data": embed(text, options.embedding_dim)}
        for index, text in enumerate(inputs)
    ]
    return _listed("pool", model, data, tokens)


def _listed(kind: str, model: str, data: list[dict[str, Any]], tokens: int) -> dict:
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": now_seconds(),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


# Every engine of the process: they serve one model.
VOCABULARY = Vocabulary()
EngineApi = Callable[[Any, EngineOptions, Vocabulary], dict]
# By path, as vLLM serves them.
ENGINE_APIS: dict[str, EngineApi] = {
    "/tokenize": tokenize_response,
    "/detokenize": detokenize_response,
    "/v1/rerank": rerank_response,
    "/rerank": rerank_response,
    "/v2/rerank": rerank_response,
    "/v1/score": score_response,
    "/score": score_response,
    "/classify": classify_response,
    "/pooling": pooling_response,
}
