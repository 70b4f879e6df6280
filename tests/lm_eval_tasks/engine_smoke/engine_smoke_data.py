"""Loads this folder's JSONL files as a ``datasets.DatasetDict`` (lm-eval's ``custom_dataset``).

The data sit next to the task YAMLs, so the tasks work from any working directory and never
touch the hub or the datasets cache (chapter 13's lm-eval client, ``tests/test_serve_lm_eval.py``).
"""

import json
from pathlib import Path

HERE = Path(__file__).parent


def _load(name: str):
    import datasets

    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def choice(**metadata):
    return _load("choice.jsonl")


def gen(**metadata):
    return _load("gen.jsonl")


def rolling(**metadata):
    return _load("rolling.jsonl")
