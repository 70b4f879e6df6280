"""Measuring speculative decoding: acceptance, tokens per target forward, decode speed next to plain
decoding, and what one verify forward of k + 1 tokens costs next to a one-token step.

Defined in chapter 11. Acceptance needs trained weights: ``acceptance_by_kind`` runs prompt lookup
on raw-text prompts for a base model of Python source (``CODE_EDIT_PROMPTS``, whose continuation can
copy the prompt, and ``FREE_TEXT_PROMPTS``, whose continuation is new text after the same code) and
reports acceptance per prompt and per kind, with where the accepted drafts were copied from. Speed
does not depend on the weights' values, so ``measure_speculative`` times a random checkpoint: beside
prompt lookup on two chat prompts (one that invites copying, one that does not) it forces the
acceptance rate, with a drafter that replays plain greedy's own continuation (everything accepted)
and one that proposes nonsense (nothing accepted), which bracket what any drafter can do on this
hardware.
"""

from __future__ import annotations

import statistics

import torch

from ..model.checkpoints import checkpoint_label
from ..sampling import SamplingParams, SamplingState
from ..speculative import PromptLookup, Replay, verify_tokens
from ..stages import sync
from .measure import timed

CHI2_CRITICAL_DF4 = 18.47  # chi-square at p = 0.001 for 4 degrees of freedom (a 5-token vocabulary)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed ``counts`` against the distribution ``probs``."""
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def first_token_counts(rule=verify_tokens, draws: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token of a 5-token vocabulary is the first one emitted after a deterministic
    draft, over ``draws`` seeded rounds of the accept/reject ``rule`` -> (counts, the model's own
    first-position distribution, which an exact rule must reproduce)."""
    logits = torch.tensor([[[1.0, 0.2, 1.6, -0.5, 0.4], [0.3, 0.0, -1.0, 2.0, 0.5]]])  # (1, k + 1, vocab 5)
    draft = torch.tensor([[2]])  # a deterministic draft (as prompt lookup's): token 2
    state = SamplingState(1, 5, torch.device("cpu"))
    mode = state.load([SamplingParams(do_sample=True, temperature=1.0, seed=123)])
    counts = torch.zeros(5)
    for _ in range(draws):
        accepted, nxt = rule(logits, draft, state, mode)
        counts[draft[0, 0] if accepted[0] > 0 else nxt[0]] += 1
    return counts, logits[0, 0].softmax(-1)

# a prompt whose answer repeats its input (lookup should shine) and one whose answer does not
EDIT_PROMPT = ("Rename the variable `x` to `total` in this function and change nothing else:\n```python\n"
               "def add_all(values):\n    x = 0\n    for v in values:\n        x = x + v\n    return x\n```")
FREE_PROMPT = "Write a short poem about the sea at night."


@torch.inference_mode()
def verify_cost(engine, ks: tuple[int, ...] = (1, 2, 4, 8), context: int = 256, repeats: int = 5) -> dict[int, float]:
    """One verify forward of k + 1 tokens over ``context`` cached ones, in units of a one-token
    forward (k = 0) through the same code: the engine's loop stopped after a prefill (``LocalLoop.paused``).
    Re-running it rewrites the same slots, so it can be timed."""
    paused = engine.loop.paused([list(range(1000, 1000 + context))], SamplingParams(max_tokens=max(ks) + 2))
    times = {k: timed(lambda k=k: paused.forward(k), engine.device, repeats=repeats) for k in (0, *ks)}
    return {k: times[k] / times[0] for k in ks}


def _run(engine, prompt, n: int, repeats: int) -> dict:
    opts = dict(max_new_tokens=n, do_sample=False, stop_token_ids=())
    engine.generate(prompt, **opts)  # warm up
    runs = [engine.generate(prompt, **opts) for _ in range(repeats)]
    sync(engine.device)
    out = {"decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs), "tokens": runs[-1].token_ids}
    out.update({k: v for k, v in runs[-1].extra.items() if k in ("acceptance_rate", "tokens_per_target_forward")})
    return out


def measure_speculative(engine, max_new_tokens: int = 48, repeats: int = 2) -> dict:
    """Plain decoding against prompt lookup and forced acceptance, on one engine's model (greedy)."""
    from ..engine import Engine

    def variant(drafter):
        return Engine(engine.model, engine.tokenizer, engine.model_dir, engine.stage, engine.device,
                      speculative=drafter)

    out = {"stage": engine.stage.name, "dtype": str(engine.dtype).removeprefix("torch."),
           "max_new_tokens": max_new_tokens, "prompts": {}}
    for name, prompt in (("edit code (lookup should help)", EDIT_PROMPT), ("free text", FREE_PROMPT)):
        plain = _run(engine, prompt, max_new_tokens, repeats)
        rows = {"plain": plain, "prompt lookup": _run(variant("prompt_lookup"), prompt, max_new_tokens, repeats),
                "replay (all accepted)": _run(variant(Replay([plain["tokens"]])), prompt, max_new_tokens, repeats),
                "nonsense (none accepted)": _run(variant(Replay([[7] * 4 * max_new_tokens])), prompt,
                                                 max_new_tokens, repeats)}
        want, base = plain["tokens"], plain["decode_tok_s"]
        for r in rows.values():
            # identical in fp32; in half precision a verify's batched matmul rounds differently from
            # a one-token step, so a near-tie can flip: recorded, not assumed
            r["matches_plain"] = r.pop("tokens") == want
            r["speedup"] = r["decode_tok_s"] / base
        out["prompts"][name] = {"prompt_tokens": len(engine.encode(prompt)), "runs": rows}
    out["verify_cost"] = {str(k): v for k, v in verify_cost(engine).items()}
    return out


# ------------------------------------------------------------------ acceptance on a trained model
# Raw text for a base model of Python source (no chat template), written for chapter 11 before the
# model's output was seen. Each pair shares its function: the code-edit prompt asks, in a comment,
# for the function again with one edit and starts the copy with its new ``def`` line, so the
# continuation can copy from the prompt; the free-text prompt starts something new after the same
# function (prose in a docstring, comment or string), so there is as much to copy from and little
# reason to.
_ADD_ALL = ("def add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
            "    return total\n\n\n")
_QUOTE_ALL = ("def quote_all(names):\n    result = []\n    for name in names:\n        result.append(repr(name))\n"
              "    return ', '.join(result)\n\n\n")
_CLAMP = ("def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
          "        return high\n    return value\n\n\n")
_READ_LINES = ("def _read_lines(path):\n    with open(path, encoding='utf-8') as f:\n"
               "        return [line.rstrip('\\n') for line in f]\n\n\n")
_RETRY = ("def retry(func, attempts=3):\n    for i in range(attempts):\n        try:\n            return func()\n"
          "        except OSError:\n            if i == attempts - 1:\n                raise\n\n\n")

CODE_EDIT_PROMPTS = {
    "rename a parameter": _ADD_ALL + "# The same function with values renamed to numbers:\ndef add_all(numbers):\n",
    "rename a local": _QUOTE_ALL + "# The same function with result renamed to quoted:\ndef quote_all(names):\n",
    "add type hints": _CLAMP + "# The same function with type hints:\ndef clamp(value: int, low: int, high: int) -> int:\n",
    "rename the function": _READ_LINES + "# The same function, renamed to read_lines:\ndef read_lines(path):\n",
    "change a default": _RETRY + "# The same function with five attempts by default:\ndef retry(func, attempts=5):\n",
}
FREE_TEXT_PROMPTS = {
    "docstring": _ADD_ALL + 'def parse_header(line):\n    """Return the',
    "comment": _QUOTE_ALL + "# This module",
    "class docstring": _CLAMP + 'class Interval:\n    """A',
    "help string": _READ_LINES + "def main():\n    parser = argparse.ArgumentParser(description='",
    "note": _RETRY + "# Note: the",
}
# a control, added after the first run showed the small model not copying the edits: the same
# function twice and the def line of a third copy, verbatim (a model that copies continues it exactly)
COPY_PROMPTS = {f"copy {name}": f + f + f.split("\n")[0] + "\n" for name, f in
                (("add_all", _ADD_ALL), ("quote_all", _QUOTE_ALL), ("clamp", _CLAMP), ("_read_lines", _READ_LINES),
                 ("retry", _RETRY))}
PROMPT_KINDS = {"code edit": CODE_EDIT_PROMPTS, "free text": FREE_TEXT_PROMPTS, "verbatim copy": COPY_PROMPTS}


class TracedLookup(PromptLookup):
    """Prompt lookup that records each round's draft and where it was copied from: the prompt,
    or the text generated so far (a model that loops drafts well from its own loop)."""

    def start(self, cache) -> None:
        self.rounds = []

    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        drafts = super().propose(requests)
        for (seq, _), draft in zip(requests, drafts):
            start = self.draft_start(seq.tokens, self.max_ngram)
            source = "none" if start is None else "prompt" if start < len(seq.prompt_ids) else "output"
            self.rounds.append((len(seq.tokens), draft, source))
        return drafts


def acceptance_by_kind(engine_or_path, prompts: dict[str, dict[str, str]] | None = None,
                       max_new_tokens: int = 24, device: str = "cpu") -> dict:
    """Prompt lookup's acceptance per prompt and per kind of prompt (chapter 11), greedy, fp32,
    ``kv_cache`` rung (so speculative output is plain greedy's token for token, and is checked).

    ``engine_or_path``: an Engine (its model is reused) or a checkpoint folder. ``prompts``: kind ->
    {name: raw text}, encoded without a chat template (default ``PROMPT_KINDS``). Per prompt: drafted
    and accepted tokens, acceptance rate, tokens per target forward, whether the output equals plain
    greedy's, how many drafted and accepted tokens were copied from the prompt and how many from the
    model's own output, and the continuation as text. Per kind: the same, pooled over its prompts."""
    from ..engine import Engine

    base = engine_or_path
    if not isinstance(base, Engine) or base.stage.name != "kv_cache" or base.dtype != torch.float32:
        path, device = (base.model_dir, base.device) if isinstance(base, Engine) else (base, device)
        base = Engine.from_pretrained(path, device=device, dtype=torch.float32, stage="kv_cache")
    drafter = TracedLookup()
    spec = Engine(base.model, base.tokenizer, base.model_dir, base.stage, base.device, speculative=drafter)
    opts = dict(max_new_tokens=max_new_tokens, do_sample=False, stop_token_ids=())
    rows = []
    for kind, named in (prompts or PROMPT_KINDS).items():
        for name, text in named.items():
            ids = base.tokenizer(text, add_special_tokens=False)["input_ids"]
            plain = base.generate(ids, **opts).token_ids
            drafter.rounds = []
            got = spec.generate(ids, **opts)
            s, seq = got.extra, ids + got.token_ids
            by_source, drafted = {"prompt": 0, "output": 0, "none": 0}, {"prompt": 0, "output": 0, "none": 0}
            for end, draft, source in drafter.rounds:  # greedy: a draft is kept while it equals the output
                kept = 0
                while kept < len(draft) and end + kept < len(seq) and draft[kept] == seq[end + kept]:
                    kept += 1
                by_source[source] += kept
                drafted[source] += len(draft)
            assert sum(by_source.values()) == s["accepted"], "traced acceptance differs from the engine's count"
            rows.append({"kind": kind, "name": name, "prompt": text, "prompt_tokens": len(ids),
                         "new_tokens": len(got.token_ids), "drafted": s["drafted"], "accepted": s["accepted"],
                         "target_forwards": s["target_forwards"],
                         "acceptance_rate": got.extra["acceptance_rate"],
                         "tokens_per_target_forward": got.extra["tokens_per_target_forward"],
                         "matches_plain": got.token_ids == plain,
                         "drafted_from_prompt": drafted["prompt"], "drafted_from_output": drafted["output"],
                         "accepted_from_prompt": by_source["prompt"], "accepted_from_output": by_source["output"],
                         "text": base.tokenizer.decode(got.token_ids)})
    kinds = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        total = lambda key, mine=mine: sum(r[key] for r in mine)
        kinds[kind] = {"prompts": len(mine), "drafted": total("drafted"), "accepted": total("accepted"),
                       "acceptance_rate": total("accepted") / max(total("drafted"), 1),
                       "tokens_per_target_forward": total("new_tokens") / total("target_forwards"),
                       "drafted_from_prompt": total("drafted_from_prompt"),
                       "drafted_from_output": total("drafted_from_output"),
                       "accepted_from_prompt": total("accepted_from_prompt"),
                       "accepted_from_output": total("accepted_from_output"),
                       "all_match_plain": all(r["matches_plain"] for r in mine)}
    return {"model": base.model_dir.name, "real_weights": checkpoint_label(base.model_dir) is None,
            "device": base.device.type, "dtype": str(base.dtype).removeprefix("torch."), "stage": base.stage.name,
            "max_new_tokens": max_new_tokens, "drafter": "prompt lookup (n-grams of 3, 2, 1 tokens)",
            "rows": rows, "kinds": kinds}
