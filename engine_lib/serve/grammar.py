"""Structured output: a grammar turned into a token mask at every step, through llguidance.

Defined in chapter 13 (an API for agents and evaluators). A grammar (a JSON schema, or a small Lark
grammar around one) says which texts are allowed. Before each pick, the matcher walks the
tokenizer's token trie from the current parser state and marks which tokens keep the text
inside the grammar; the sampler sets every other logit to -inf, picks, and the matcher
advances on the chosen token. The end-of-sequence token is allowed only where the grammar
accepts the text, so the output is complete as well as valid.

Why llguidance (checked against the packages' own metadata and docs, llguidance 1.9.1,
xgrammar 0.2.8, outlines-core 0.2.14):

- llguidance ships one ``abi3`` wheel (one build for every CPython >= 3.10) with no
  ``Requires-Dist`` at all. xgrammar 0.2.8 requires ``apache-tvm-ffi``, ``torch``,
  ``transformers``, ``numpy``, ``pydantic`` and, on Linux x86-64, ``triton``, in one wheel per
  Python version. outlines-core has no runtime dependencies either, but a wheel per version.
- It computes each mask lazily, at the step it is needed, from the current parser state
  (its README: "on the order of 50μs of CPU time per token (for 128k tokenizer) with
  negligible startup costs"); measured here in ``tests/test_serve_grammar.py``. outlines-core
  builds an ``Index`` up front that maps every (automaton state, vocabulary token) pair,
  whose size "may grow significantly with the complexity of the input"; xgrammar compiles each
  grammar against the tokenizer (a ``GrammarCompiler`` per tokenizer, with a cache of
  compiled grammars) before the first token.
- It takes JSON schemas, regular expressions and context-free grammars in a Lark-like syntax
  with JSON schemas embedded (``%json {...}``), which is how a tool call's
  ``<tool_call>...</tool_call>`` wrapper is written below. outlines-core turns a JSON schema
  into one regular expression, so it has no recursion and no wrapper grammar.
- It is what guided decoding runs on in vLLM and SGLang (an option of each), in llama.cpp
  (``-DLLAMA_LLGUIDANCE=ON``) and in Microsoft's guidance; OpenAI uses it for Structured
  Outputs (all from its README).

Nothing here runs for a request without a grammar: such a row's sampler has no matcher, and
the sampler makes no mask for it (see ``sampler.py``).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import torch

# JSON written as json.dumps writes it (", " and ": ", no other whitespace): Qwen2.5 writes tool
# calls that way, and a model cannot stall the output on endless whitespace
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar that llguidance cannot use: the server answers 400 with this message."""


_TOKENIZERS: dict[tuple, object] = {}
_TOKENIZERS_LOCK = threading.Lock()  # the first grammar requests may arrive together: build once


def ll_tokenizer(hf_tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of the vocabulary (its token trie): about a second, so once per server.

    ``vocab_size`` is the model's (Qwen2.5 pads its 151,665 tokens to 151,936 rows of logits);
    ``eos_ids`` are the tokens that end a sequence, allowed only when the grammar accepts.
    """
    import llguidance.hf

    key = (id(hf_tokenizer), vocab_size, tuple(eos_ids))
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            built = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
            _TOKENIZERS[key] = (hf_tokenizer, built)  # held, so its id is not reused
        return _TOKENIZERS[key][1]


def _checked(grammar: str, what: str) -> str:
    """The grammar, or a GrammarError saying why llguidance refuses it (an unsupported keyword...)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"{what}: {error.strip().splitlines()[0]}")
    return grammar


def _with_layout(schema: dict) -> dict:
    return {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}


def json_schema_grammar(schema: dict | None) -> str:
    """A JSON schema (None: any JSON object) -> an llguidance grammar."""
    from llguidance import LLMatcher

    if schema is not None and not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be an object")
    try:
        grammar = LLMatcher.grammar_from_json_schema(_with_layout(schema or {"type": "object"}))
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None
    return _checked(grammar, "unusable JSON schema")


def response_format_grammar(response_format: dict | None) -> str | None:
    """OpenAI's ``response_format`` -> a grammar, or None for plain text."""
    if not response_format or response_format.get("type", "text") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return json_schema_grammar(None)
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        if "schema" not in spec:
            raise GrammarError("response_format json_schema needs json_schema.schema")
        return json_schema_grammar(spec["schema"])
    raise GrammarError(f"unknown response_format type {kind!r}: use text, json_object or json_schema")


def tool_call_grammar(tools: list[dict], forced: str | None, open_id: int, close_id: int,
                      several: bool = True) -> str:
    """``required`` (forced=None: any offered function, one call or more unless ``several`` is
    False, as ``parallel_tool_calls: false`` asks) or a named function (exactly one call to it)
    -> ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``.

    ``open_id``/``close_id`` are the ``<tool_call>``/``</tool_call>`` token ids (single tokens in
    Qwen2.5's vocabulary); the JSON between them is held to the function's parameters schema.
    """
    from llguidance import LLMatcher

    functions = [t["function"] for t in tools]
    if forced is not None:
        functions = [f for f in functions if f["name"] == forced]
        if not functions:
            raise GrammarError(f"tool_choice names the function {forced!r}, which is not among the tools")
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = _with_layout(calls[0] if len(calls) == 1 else {"anyOf": calls})
    repeat = ' ("\\n" call)*' if several and forced is None else ""
    lark = (f"start: call{repeat}\n"
            f'call: <[{open_id}]> "\\n" %json {json.dumps(schema)} "\\n" <[{close_id}]>\n')
    return _checked(LLMatcher.grammar_from_lark(lark), "unusable tool parameters schema")


class GrammarMatcher:
    """One sequence's grammar state: which tokens may come next, and the token that came."""

    def __init__(self, tokenizer, grammar: str):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self.eos_ids = list(tokenizer.eos_tokens)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self.matcher.get_error()}")

    def _allowed(self, vocab_size: int) -> np.ndarray:
        # numpy, not torch: a 150k-element torch op may fan out to worker threads, and on a busy
        # CPU waiting for them costs milliseconds; these few vector ops take ~100 us in one thread
        allowed = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8) != 0  # 0 or 200 per token
        if not allowed.any():  # a matcher in error allows nothing: end the sequence, never pick from -inf
            allowed[self.eos_ids] = True
        if allowed.size < vocab_size:  # rows past the tokenizer's vocabulary are never allowed
            allowed = np.concatenate([allowed, np.zeros(vocab_size - allowed.size, dtype=bool)])
        return allowed[:vocab_size]

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """(vocab_size,) bool, True for the tokens allowed next (EOS only where the grammar accepts)."""
        return torch.from_numpy(self._allowed(vocab_size))

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(vocab,) logits with every token the grammar forbids at -inf (a new float32 tensor)."""
        allowed = self._allowed(logits.shape[-1])
        if logits.device.type == "cpu":
            return torch.from_numpy(np.where(allowed, logits.detach().float().numpy(), np.float32("-inf")))
        allowed = torch.from_numpy(allowed).to(logits.device, non_blocking=True)
        return logits.float().masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> bool:
        """Take the picked token; False if the grammar refused it (the matcher is then in error)."""
        return self.matcher.consume_token(token)

    def is_finished(self) -> bool:
        """The grammar is complete: nothing but an end-of-sequence token may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()
