"""Perplexity of a text under the model: a sliding window, like llama.cpp's ``perplexity`` tool.

Defined in chapter 10 (a measurement of what quantization costs). The text is tokenized as it
is, with no chat template and no BOS token (Qwen's tokenizer adds none). A window of
``context`` tokens moves by ``stride``; each window scores only the tokens that no earlier
window scored, so every window but the first spends its first ``context - stride`` tokens as
context only, and every token after the first is scored exactly once (with ``stride ==
context`` the windows do not overlap, and each window's first token goes unscored: it has no
context inside its window). Perplexity is ``exp(mean negative log-likelihood)`` over the scored
tokens, with the log-softmax taken in fp32 (as logsumexp minus the target's logit), from the model's
full forward (no KV cache; the LM head runs only on the positions that are scored).

The same function runs on Colab with the real model and a real text: only the numbers change.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

LOGSOFTMAX_ROWS = 512  # positions scored in fp32 at once: bounds the (rows, vocab) temporary


@dataclass
class PerplexityResult:
    """``ppl = exp(nll_sum / tokens)``; ``tokens`` is the number of scored tokens."""

    ppl: float
    nll_sum: float
    tokens: int
    windows: int
    context: int
    stride: int
    text_tokens: int  # tokens in the text (scored ones + the unscored first token of each context-free start)
    seconds: float
    settings: dict = field(default_factory=dict)  # model, stage, dtype, device, ...

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens

    def summary(self) -> str:
        s = self.settings
        where = ", ".join(f"{k} {s[k]}" for k in ("model", "stage", "dtype", "device") if k in s)
        return (f"perplexity {self.ppl:.4f} (mean NLL {self.mean_nll:.4f} nats) over {self.tokens} scored tokens "
                f"of {self.text_tokens} | context {self.context}, stride {self.stride}, {self.windows} windows | "
                f"{where} | {self.seconds:.1f} s")

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_nll": self.mean_nll}


def windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over ``n_tokens`` tokens.

    Position j is scored from the logits at j - 1, so a window [begin, end) can score j in
    [max(begin + 1, previous end), end)."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    out, prev_end = [], 0
    for begin in range(0, max(n_tokens - 1, 1), stride):
        end = min(begin + context, n_tokens)
        first = max(begin + 1, prev_end)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _model_of(engine_or_model):
    return getattr(engine_or_model, "model", engine_or_model) if hasattr(engine_or_model, "tokenizer") \
        else engine_or_model


@torch.inference_mode()
def window_nll(model, ids: torch.Tensor, first: int) -> tuple[float, int]:
    """Sum of -log p(ids[j] | ids[:j]) for j in [first, len(ids)), from one forward of ``ids``."""
    # logits at positions first-1 .. seq-2 predict tokens first .. seq-1: (scored, vocab), model dtype
    logits = model(ids[:-1].view(1, -1), logits_from=first - 1)[0]
    total = 0.0
    for a in range(0, logits.shape[0], LOGSOFTMAX_ROWS):
        rows = logits[a:a + LOGSOFTMAX_ROWS].float()
        target = ids[first + a:first + a + rows.shape[0]].view(-1, 1)
        # -log softmax(rows)[target] = logsumexp(rows) - rows[target], in fp32
        total += (rows.logsumexp(-1) - rows.gather(1, target)[:, 0]).double().sum().item()
    return total, ids.numel() - first


def perplexity(engine_or_model, token_ids, context: int = 512, stride: int | None = None,
               progress: bool | None = None, settings: dict | None = None) -> PerplexityResult:
    """Perplexity of ``token_ids`` (a list or 1-D tensor) under an ``Engine`` or a bare model.

    ``stride`` defaults to ``context // 2``. ``progress``: a tqdm bar (default: on when there are
    more than 8 windows)."""
    model = _model_of(engine_or_model)
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    stride = stride or max(1, context // 2)
    spans = windows(ids.numel(), context, stride)
    if not spans:
        raise ValueError(f"the text has {ids.numel()} token(s): at least 2 are needed")
    device = next(model.parameters()).device
    ids = ids.to(device)
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    nll, scored = 0.0, 0
    bar = tqdm(spans, desc="perplexity", unit="window", disable=not (len(spans) > 8 if progress is None else progress))
    for begin, end, first in bar:
        s, n = window_nll(model, ids[begin:end], first - begin)
        nll, scored = nll + s, scored + n
        bar.set_postfix(ppl=f"{math.exp(nll / scored):.3f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info = dict(settings or {})
    if hasattr(engine_or_model, "stage"):
        eng = engine_or_model
        info = {"model": eng.model_dir.name, "stage": eng.stage.name,
                "quant_method": getattr(eng, "quant_method", None), **info}
    info.setdefault("dtype", str(model.dtype).removeprefix("torch."))
    info.setdefault("device", device.type if device.type == "cpu" else torch.cuda.get_device_name(device))
    return PerplexityResult(math.exp(nll / scored), nll, scored, len(spans), context, stride, ids.numel(),
                            time.perf_counter() - t0, info)


def text_ids(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """The text's token ids as they are: no chat template, no BOS; the first ``max_tokens``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:max_tokens] if max_tokens else ids


def perplexity_of_file(engine, path: str | Path, context: int = 512, stride: int | None = None,
                       max_tokens: int | None = None, progress: bool | None = None) -> PerplexityResult:
    text = Path(path).read_text(encoding="utf-8")
    result = perplexity(engine, text_ids(engine.tokenizer, text, max_tokens), context, stride, progress)
    result.settings["text"] = Path(path).name
    return result
