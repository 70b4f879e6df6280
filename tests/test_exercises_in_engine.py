"""engine_lib/exercises/in_engine.py: the reader's piece inside the engine for a real generation, compared
with the engine's own (exercises 02.1 and 11.1)."""

import pytest
import torch

from engine_lib.exercises._grading import Mismatch, tiny_engine
from engine_lib.exercises.in_engine import lookup_in_engine, norms_replaced, rms_norm_in_engine
from engine_lib.model.layers.rmsnorm import RMSNorm
from engine_lib.speculative import PromptLookup


def right_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype)


def test_the_engines_own_pieces_pass():
    rms_norm_in_engine(right_norm)
    lookup_in_engine(PromptLookup.lookup)


def test_a_norm_that_is_slightly_off_changes_the_logits():
    with pytest.raises(Mismatch, match="logits over prompt and reply"):
        rms_norm_in_engine(lambda x, w, eps: right_norm(x, w, eps) * 1.001)


def test_a_norm_that_ignores_its_weight_changes_the_reply():
    with pytest.raises(Mismatch, match="token|logits"):
        rms_norm_in_engine(lambda x, w, eps: right_norm(x, torch.ones_like(w), eps))


def test_a_lookup_that_drafts_differently_is_caught_though_the_reply_is_right():
    with pytest.raises(Mismatch, match="drafted"):
        lookup_in_engine(lambda context, k, n: context[-k:])


def test_the_norms_come_back_after_the_check():
    engine = tiny_engine()
    norms = [m for m in engine.model.modules() if isinstance(m, RMSNorm)]
    with norms_replaced(engine.model, lambda x, w, eps: x) as n:
        assert n == len(norms) > 0 and all("forward" in vars(m) for m in norms)
    assert not any("forward" in vars(m) for m in norms)
