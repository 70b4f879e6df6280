"""Exercises of chapter 01 (tokens): each token's bytes, partial characters, the chat template."""

from __future__ import annotations

from functools import lru_cache

from ..model.tokenizer import chat_ids, load_tokenizer
from ._grading import Mismatch, expect_equal, grade

SOLUTIONS = "01_tokens"
EXERCISES = [
    ("The bytes of every token", """\
Byte-level BPE stores each token as a string of printable stand-in characters, one per byte
(`tokenizer.convert_ids_to_tokens`). Write `token_bytes(tokenizer, ids)` that returns the raw
bytes of each token as a list of `bytes`. You need the inverse of GPT-2's byte-to-character
table: the bytes 33-126, 161-172 and 174-255 stand for themselves (`chr(b)`), and the other 68
bytes, in increasing order, for `chr(256)`, `chr(257)`, and so on. A special token such as
`<|im_end|>` stands for its own text. Try `"🫠"` and `"🧑🏽‍🚀"`: how many tokens is each, and
which tokens are not whole characters?

```python
check.ex01_1(token_bytes)
```"""),
    ("Count the partial characters", """\
Write `partial_tokens(tokenizer, text)` that returns how many tokens of `text` are not valid UTF-8
on their own, i.e. that `tokenizer.decode([id])` alone turns into the replacement character
`"\\ufffd"`. Why must a streaming server never decode such a token alone? (Chapter 09 builds the
decoder that waits.)

```python
check.ex01_2(partial_tokens)
```"""),
    ("The chat template by hand", """\
Write `chatml(messages)` that builds the chat template string for a list of
`{"role": ..., "content": ...}` messages, ready for the assistant's reply, so that
`tokenizer.encode(chatml(messages))` equals `chat_ids(tokenizer, messages)`. Look at what the
template adds when a conversation has no system message of its own.

```python
check.ex01_3(chatml)
```"""),
]

TEXTS = [("plain English", "Hello world, tokens!"), ("a rare emoji split into byte pieces", "🫠"),
         ("an astronaut with a skin tone", "🧑🏽\u200d🚀"), ("Fraktur letters", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"),
         ("Japanese", "日本語のテキスト"), ("an accented word", "café crème"), ("the empty string", "")]


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in kept]
    table = {b: chr(b) for b in kept} | {b: chr(256 + n) for n, b in enumerate(others)}
    return {c: b for b, c in table.items()}


def _token_bytes(tok, ids: list[int]) -> list[bytes]:
    dec = _byte_decoder()
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    out = []
    for i, piece in zip(ids, tok.convert_ids_to_tokens(ids)):
        out.append(piece.encode() if i in special else bytes(dec[c] for c in piece))
    return out


def ex01_1(token_bytes) -> bool:
    tok = load_tokenizer()
    texts = TEXTS[:3] + [("an accented word", "café crème"),
                         ("a chat turn with special tokens", "<|im_start|>user\nhi<|im_end|>")]

    def check(text):
        ids = tok.encode(text)
        got = token_bytes(tok, ids)
        want = _token_bytes(tok, ids)
        if not isinstance(got, list) or len(got) != len(want):
            raise Mismatch(f"expected a list of {len(want)} bytes objects, got {type(got).__name__} "
                           f"of length {len(got) if hasattr(got, '__len__') else '?'}")
        for n, (g, w) in enumerate(zip(got, want)):
            if g != w:
                raise Mismatch(f"token {n} (id {ids[n]}) gives {g!r}, expected {w!r}")
        expect_equal(b"".join(got), text.encode(), "your bytes joined")
    cases = [(label, lambda t=t: check(t)) for label, t in texts]
    return grade("Exercise 01.1", cases, hint="invert the byte-to-character table and map every character of the token "
                                              "string back to its byte; special tokens are plain text.")


def _partial(tok, text: str) -> int:
    return sum("\ufffd" in tok.decode([i]) for i in tok.encode(text))


def ex01_2(partial_tokens) -> bool:
    tok = load_tokenizer()
    cases = [(label, lambda t=t: expect_equal(partial_tokens(tok, t), _partial(tok, t), f"partial_tokens({t!r})"))
             for label, t in TEXTS]
    return grade("Exercise 01.2", cases, hint="decode each id alone and look for '\\ufffd'.")


CONVERSATIONS = [
    ("one user turn, no system message", [{"role": "user", "content": "What is a KV cache?"}]),
    ("a system message of your own", [{"role": "system", "content": "Answer in one line."},
                                      {"role": "user", "content": "Name a prime."}]),
    ("two user turns and one assistant turn", [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to 3."}]),
    ("a multi-line message", [{"role": "user", "content": "line one\nline two"}]),
]


def ex01_3(chatml) -> bool:
    tok = load_tokenizer()

    def check(messages):
        text = chatml([dict(m) for m in messages])
        if not isinstance(text, str):
            raise Mismatch(f"chatml should return a str, got {type(text).__name__}")
        got, want = tok.encode(text), chat_ids(tok, messages)
        if got != want:
            n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            expected = tok.decode(want[n:n + 8])
            yours = tok.decode(got[n:n + 8])
            raise Mismatch(f"the tokens part at token {n}: yours continue {yours!r}, the template's {expected!r}")
    cases = [(label, lambda m=m: check(m)) for label, m in CONVERSATIONS]
    return grade("Exercise 01.3", cases, hint="print tokenizer.decode(chat_ids(tokenizer, messages)) and "
                                              "compare it with your string.")
