"""What precise routing's `tokenizer: {kind: hf}` costs per request: a Hugging Face byte-level
BPE tokenizing long chat prompts, whole and piece by piece (kvgate/routing/hf_tokenizer.py).

Our machines have no model hub, so the tokenizer is trained here, the same way every time: a
byte-level BPE of up to 32,000 tokens (the size of Llama 2's and Mistral's vocabularies; Llama
3's is 128k) on this repository's own Python and Markdown files and on text of the words the
chats are made of (so that, as a real tokenizer does with English, it knows them), with Llama
3's special tokens and a chat template shaped like Llama 3's. Its encoding speed is that of
the `tokenizers` library on text of this kind, not any one model's.

Three cases, each a chat of about `--tokens` tokens (a system prompt of a quarter of them, then
user and assistant turns):
- whole: the rendered chat encoded in one pass, as without piecewise encoding;
- piecewise, all new: the same chat met for the first time, every piece encoded;
- piecewise, next turn: a conversation's next request, its earlier messages seen before.

Then what an all-new chat's encoding does to the event loop: a timer due every millisecond
runs while chats are encoded one after another, inline (on the loop) and on a worker thread
(as precise routing does, `TokenizeStage`); the timer's lateness p99 / max is how long any
other request's relay would have waited.

    .venv/bin/python benchmarks/hf_tokenize_cost.py [--tokens 8000 --samples 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from workloads import words

from kvgate.routing.hf_tokenizer import HfTokenizer

REPO = Path(__file__).resolve().parent.parent
VOCABULARY = 32_000
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def train(folder: Path) -> None:
    """A byte-level BPE and its chat template in `folder`, trained on the repository's text."""
    files = sorted(
        str(p)
        for pattern in ("kvgate/**/*.py", "docs/*.md", "tests/**/*.py")
        for p in REPO.glob(pattern)
    )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCABULARY,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(1)
    texts = [Path(name).read_text() for name in files]
    texts += [words(rng, 1000) for _ in range(200)]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "bos_token": SPECIALS[0], "eos_token": SPECIALS[3]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def conversation(rng: random.Random, tokens: int) -> list[dict[str, Any]]:
    """A system prompt of a quarter of `tokens` words, then turns of 600 words, to `tokens`
    words in all."""
    messages = [{"role": "system", "content": words(rng, tokens // 4)}]
    while sum(len(m["content"].split()) for m in messages) < tokens:
        messages.append({"role": "user", "content": words(rng, 350)})
        messages.append({"role": "assistant", "content": words(rng, 250)})
    messages.append({"role": "user", "content": words(rng, 350)})
    return messages


def p50_p99_us(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50": 1e6 * ordered[len(ordered) // 2],
        "p99": 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def measure(tokens: int, samples: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        train(folder)
        trained = time.perf_counter() - started
        tokenizer = HfTokenizer.load(folder)
    assert tokenizer.piecewise, "the probes should accept a byte-level BPE"
    whole_tokenizer = tokenizer._tokenizer
    rng = random.Random(0)
    whole: list[float] = []
    first: list[float] = []
    following: list[float] = []
    lengths: list[int] = []
    for _ in range(samples):
        chat = conversation(rng, tokens)
        payload = {"messages": chat}
        text = tokenizer.render_chat(payload)
        assert text is not None
        t0 = time.perf_counter()
        ids = whole_tokenizer.encode(text, add_special_tokens=False).ids
        whole.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert tokenizer.prompt_ids("chat", payload) == ids  # pieces give the whole's ids
        first.append(time.perf_counter() - t0)
        lengths.append(len(ids))
        chat += [
            {"role": "assistant", "content": words(rng, 250)},
            {"role": "user", "content": words(rng, 350)},
        ]
        t0 = time.perf_counter()
        tokenizer.prompt_ids("chat", payload)
        following.append(time.perf_counter() - t0)
    return {
        "loop_timer_late": loop_lateness(tokenizer, tokens, samples),
        "trained_s": trained,
        "prompt_tokens": statistics.mean(lengths),
        "whole_us": p50_p99_us(whole),
        "piecewise_all_new_us": p50_p99_us(first),
        "piecewise_next_turn_us": p50_p99_us(following),
    }


async def _timer_lateness(encode: Any, chats: list[dict[str, Any]], threaded: bool) -> list[float]:
    """Seconds each 1 ms timer fired late while `chats` were encoded inline or threaded."""
    loop = asyncio.get_running_loop()
    late: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            late.append(loop.time() - due)

    task = asyncio.create_task(ticker())
    with ThreadPoolExecutor(1) as worker:
        for payload in chats:
            if threaded:
                await loop.run_in_executor(worker, encode, "chat", payload)
            else:
                encode("chat", payload)
                await asyncio.sleep(0)
    done = True
    await task
    return late


def loop_lateness(tokenizer: HfTokenizer, tokens: int, samples: int) -> dict[str, Any]:
    """The 1 ms timer's lateness (ms) with all-new chats encoded inline and on a thread."""
    rng = random.Random(2)
    out: dict[str, Any] = {}
    for threaded in (False, True):
        chats = [{"messages": conversation(rng, tokens)} for _ in range(samples)]
        late = sorted(asyncio.run(_timer_lateness(tokenizer.prompt_ids, chats, threaded)))
        out["threaded" if threaded else "inline"] = {
            "p99_ms": 1e3 * late[min(len(late) - 1, int(0.99 * len(late)))],
            "max_ms": 1e3 * late[-1],
        }
    return out


def summary(out: dict[str, Any]) -> str:
    def pair(key: str) -> str:
        return f"p50 {out[key]['p50']:.0f} / p99 {out[key]['p99']:.0f} µs"

    late = out["loop_timer_late"]

    return (
        f"Hugging Face byte-level BPE (up to {VOCABULARY} tokens, trained here in "
        f"{out['trained_s']:.1f} s), chat prompts of {out['prompt_tokens']:.0f} tokens on "
        f"average: whole {pair('whole_us')}; piecewise, all new {pair('piecewise_all_new_us')}; "
        f"piecewise, next turn {pair('piecewise_next_turn_us')}. A 1 ms timer on the event "
        "loop while all-new chats are encoded, late by p99 / max: inline "
        f"{late['inline']['p99_ms']:.1f} / {late['inline']['max_ms']:.1f} ms, on a worker thread "
        f"{late['threaded']['p99_ms']:.1f} / {late['threaded']['max_ms']:.1f} ms."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8000, help="words per chat (≈ tokens)")
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args()
    out = measure(args.tokens, args.samples)
    print(json.dumps(out, indent=1))
    print(summary(out))


if __name__ == "__main__":
    main()
