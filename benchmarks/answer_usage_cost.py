"""What reading a non-stream answer's usage costs the gateway: `kvgate.upstream.answer_usage`
beside decoding the whole answer, on answers an engine really sends. In-process, no sockets.

    .venv/bin/python benchmarks/answer_usage_cost.py [--repeat 7]

Answers: `fast_upstream.py`'s small chat answer; its chat answer of 500 tokens with five top
log-probabilities each (`--answer-logprobs 500`, about 160 KB); an embeddings answer of 32
inputs of 4,096 dimensions (as vLLM serves a 4k-dimension embedding model; about 2.7 MB).
Each figure is the best of `--repeat` timing loops, µs per answer.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import orjson
from fast_upstream import COMPLETION, logprobs_completion

from kvgate.upstream.answer_usage import answer_usage


def embeddings_answer(inputs: int, dimensions: int) -> bytes:
    rng = random.Random(0)
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": [rng.gauss(0, 0.05) for _ in range(dimensions)],
        }
        for i in range(inputs)
    ]
    return orjson.dumps(
        {
            "id": "embd-1",
            "object": "list",
            "created": 0,
            "model": "m",
            "data": data,
            "usage": {"prompt_tokens": 512, "total_tokens": 512},
        }
    )


def best_us(action: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` loops, each about 0.2 s, in µs per call."""
    start = time.perf_counter()
    action()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(0.2 / once))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            action()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    answers = {
        "small chat answer": COMPLETION,
        "chat, 500 tokens with top-5 log-probabilities": logprobs_completion(500),
        "embeddings, 32 x 4,096 dimensions": embeddings_answer(32, 4096),
    }
    print("| answer | bytes | decoded whole, µs | `answer_usage`, µs |")
    print("|---|---|---|---|")
    for name, body in answers.items():
        whole = best_us(lambda body=body: orjson.loads(body), args.repeat)
        scanned = best_us(lambda body=body: answer_usage(body), args.repeat)
        assert answer_usage(body)[0] == orjson.loads(body)["usage"]
        print(f"| {name} | {len(body):,} | {whole:,.1f} | {scanned:,.1f} |")


if __name__ == "__main__":
    main()
