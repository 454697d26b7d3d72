"""Small Hugging Face tokenizers trained in the tests (our machines have no model hub)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, trainers

LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
WORDS = ["the", "gears", "turn", "while", "a", "gateway", "routes", "prompts", "to"]
WORDS += ["engines,", "42", "times;", "über", "fast!"]


def bpe_tokenizer(folder: Path, pre_tokenizer: Any, specials: list[str], template: str) -> Any:
    """A small trained BPE with `specials` and a chat template, saved to `folder`."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", *specials])
    rng = random.Random(3)
    tokenizer.train_from_iterator(
        [" ".join(rng.choice(WORDS) for _ in range(40)) + "\n\n" for _ in range(50)], trainer
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": specials[0]})
    )
    return tokenizer
