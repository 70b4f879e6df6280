"""The Qwen2.5 tokenizer and ChatML template, through ``transformers.AutoTokenizer``.

Defined in chapter 01 (tokens). The real tokenizer files are vendored under
``engine_lib/assets/qwen2.5-tokenizer`` (Apache-2.0, see NOTICE), so it works offline.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

VENDORED_TOKENIZER = Path(__file__).parents[1] / "assets" / "qwen2.5-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SEED_PROMPTS_FILE = VENDORED_TOKENIZER / "seed_prompts_tokenized.json"


@lru_cache(maxsize=4)
def load_tokenizer(path: str | Path | None = None):
    """The tokenizer in ``path`` if it has one, else the vendored Qwen2.5 tokenizer."""
    from transformers import AutoTokenizer

    folder = Path(path) if path is not None else VENDORED_TOKENIZER
    if not (folder / "tokenizer.json").is_file():
        folder = VENDORED_TOKENIZER
    return AutoTokenizer.from_pretrained(str(folder))


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` under the chat template, ready for the assistant's reply."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def seed_prompts() -> list[dict]:
    """The book's ten prompts: ``prompt``, ``chat_text`` and reference ``input_ids``."""
    return json.loads(SEED_PROMPTS_FILE.read_text())["prompts"]
