"""Every per-request option in one validated object: ``SamplingParams``.

Defined in chapter 09 (beyond greedy); the server's options (chapters 12 and 13) are fields of the same
object. Defaults come from the checkpoint's ``generation_config.json``, as in ``transformers``; a call's
options are applied with ``merged``, which refuses a misspelt name with the closest one ("did you
mean") and a value it cannot take (NaN, infinite, out of range, of the wrong type) with an
``OptionValueError`` that names both. Validated once, when the object is made: everything downstream
(the step, the loop, the server) trusts it.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from numbers import Integral, Real
from pathlib import Path

from ..errors import OptionValueError, UnsupportedOptionError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, when to stop, and what to report. ``do_sample=False`` or ``temperature=0`` means
    greedy (argmax)."""

    # chapter 09: the pick
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off (transformers' rule: seen tokens' logits / or * it)
    seed: int | None = None
    # chapters 12 and 13: what OpenAI's and vLLM's requests add to the pick
    min_p: float = 0.0  # drop tokens below min_p times the top one's probability; 0 = off
    presence_penalty: float = 0.0  # OpenAI's, over the generated tokens: logit - presence * (count > 0)
    frequency_penalty: float = 0.0  # ... - frequency * count
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # how long, and when to stop
    max_tokens: int | None = None  # new tokens at most; None: the caller's default (the rest of the context)
    min_tokens: int = 0  # stop tokens and stop strings wait until this many tokens are out
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (the reply ends before the first one)
    include_stop_str: bool = False  # keep a matched stop string in the text (vLLM's include_stop_str_in_output)
    # what to report
    logprobs: int | None = None  # top alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions' echo)
    # structured output: an llguidance grammar the reply must follow (chapter 13); None: free text
    grammar: str | None = None
    # speculative decoding (chapter 11): drafted tokens per step at most for this request; 0: none; None: the
    # engine's own setting
    speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        # NaN fails no comparison (so `nan < 0` let it through, as greedy-like output): finite first
        check_number("temperature", self.temperature, "a finite number >= 0 (0 = greedy)", lambda v: v >= 0)
        check_number("top_p", self.top_p, "a number in (0, 1]", lambda v: 0 < v <= 1)
        check_number("min_p", self.min_p, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        check_number("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)", lambda v: v > 0)
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(name, getattr(self, name), "a finite number (0 = off)", lambda v: True)
        check_whole("top_k", self.top_k, "an integer >= 0 (0 = off)")
        check_whole("min_tokens", self.min_tokens, "an integer >= 0")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "speculative_tokens"):
            if getattr(self, name) is not None:
                check_whole(name, getattr(self, name), "an integer >= 0, or None")
        for name in ("do_sample", "include_stop_str"):
            if not isinstance(getattr(self, name), bool):
                raise OptionValueError(name, getattr(self, name), "True or False")
        if self.seed is not None and not is_int(self.seed):
            raise OptionValueError("seed", self.seed, "an integer or None")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise OptionValueError("stop_token_ids", self.stop_token_ids, "token ids (integers >= 0)")
        if not all(isinstance(s, str) for s in self.stop):
            raise OptionValueError("stop", self.stop, "strings")
        for pair in self.logit_bias:
            if len(pair) != 2 or not is_int(pair[0]) or pair[0] < 0:
                raise OptionValueError("logit_bias", self.logit_bias, "(token id, bias) pairs")
            check_number("logit_bias", pair[1], "finite biases", lambda v: True)
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise OptionValueError("grammar", self.grammar, "a grammar's text, or None")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before the pick (``loop.processors.LogitsAdjust``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.min_p or self.logit_bias
                    or self.min_tokens)

    @classmethod
    def from_generation_config(cls, path: str | Path) -> SamplingParams:
        """The checkpoint's defaults (Qwen2.5-Instruct: sample, T=0.7, top-p 0.8, top-k 20, penalty 1.1)."""
        path = Path(path)
        if not path.is_file():
            return cls()
        raw = json.loads(path.read_text())
        eos = raw.get("eos_token_id", [])
        return cls(do_sample=bool(raw.get("do_sample", False)),
                   temperature=float(raw.get("temperature", 1.0)),
                   top_k=int(raw.get("top_k", 0) or 0), top_p=float(raw.get("top_p", 1.0)),
                   repetition_penalty=float(raw.get("repetition_penalty", 1.0)),
                   stop_token_ids=tuple(eos if isinstance(eos, list) else [eos]))

    def merged(self, **overrides) -> SamplingParams:
        """Apply a call's options. ``do_sample=False`` alone gives *plain* greedy: unlike
        ``transformers``, the checkpoint's repetition penalty is not kept unless asked for.
        A misspelt option is an ``UnsupportedOptionError`` that suggests the name meant."""
        check_option_names(overrides)
        given = {k: v for k, v in overrides.items() if v is not None}
        if given.get("do_sample") is False or given.get("temperature") == 0:
            given.setdefault("repetition_penalty", 1.0)
        for name in ("stop_token_ids", "stop"):
            if name in given:
                given[name] = (given[name],) if isinstance(given[name], str) else tuple(given[name])
        if isinstance(given.get("logit_bias"), dict):
            given["logit_bias"] = tuple((int(k), v) for k, v in given["logit_bias"].items())
        elif "logit_bias" in given:
            given["logit_bias"] = tuple(tuple(pair) for pair in given["logit_bias"])
        return replace(self, **given)


OPTIONS = tuple(f.name for f in fields(SamplingParams))  # the names generate() and merged() take


def is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_number(name: str, value, rule: str, ok: Callable[[float], bool]) -> None:
    """A finite real number (not a bool, not a string) that passes ``ok``, or an error naming both."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not ok(value):
        raise OptionValueError(name, value, rule)


def check_whole(name: str, value, rule: str) -> None:
    if not is_int(value) or value < 0:
        raise OptionValueError(name, value, rule)


def check_option_names(names: Iterable[str]) -> None:
    """Every name a generation option: a typo is an error with the closest name, not a bare TypeError."""
    for name in names:
        if name not in OPTIONS:
            close = difflib.get_close_matches(name, OPTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnsupportedOptionError(f"unknown generation option {name!r}{hint} (the options: "
                                         f"{', '.join(OPTIONS)})")
