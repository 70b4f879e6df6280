"""The model/cache contract: per-layer buffers written in place at explicit slots, masks by slot,
several new tokens over a filled cache (a verify step), and rolling the write position back."""

import pytest
import torch

from engine_lib.cache.contiguous import KVCache, KVLayer, visible_slots, write_kv


def make_cache(model, batch, max_len):
    cfg = model.config
    return KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, max_len,
                   model.lm_head.weight.dtype, "cpu")


def slots(start, n, batch=1):
    return torch.arange(start, start + n).expand(batch, n)


def test_one_separate_buffer_per_layer(engines):
    cache = make_cache(engines("kv_cache").model, 2, 64)
    assert len(cache.k) == len(cache.v) == 4
    assert len({t.untyped_storage().data_ptr() for t in cache.k + cache.v}) == 8  # no shared 5-D tensor
    assert cache.k[0].shape == (2, 2, 64, 32)
    assert cache.nbytes == 8 * 2 * 2 * 64 * 32 * 4


def test_write_kv_writes_each_row_at_its_own_slots_in_place():
    k_buf, v_buf = torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 4)
    before = k_buf.data_ptr()
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    pos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    kr, vr = write_kv(k_buf, v_buf, k, v, torch.arange(2)[:, None], pos, kv_len=7)
    assert k_buf.data_ptr() == before and kr.shape == (2, 2, 7, 4)
    torch.testing.assert_close(k_buf[0, :, 0:3], k[0])
    torch.testing.assert_close(v_buf[1, :, 4:7], v[1])
    assert k_buf[0, :, 3:].abs().sum() == 0 and k_buf[1, :, :4].abs().sum() == 0


def test_visible_slots_is_causal_by_slot_and_hides_padding():
    pos = torch.tensor([[2, 3], [2, 3]])
    valid = torch.tensor([[True] * 5, [False, True, True, True, True]])
    m = visible_slots(pos, valid, 5)[:, 0]  # (batch, seq, kv_len)
    assert m[0].tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
    assert m[1].tolist() == [[False, True, True, False, False], [False, True, True, True, False]]
    assert visible_slots(torch.tensor([[0]]), torch.tensor([[False]]), 1).all()  # a query sees itself


@pytest.mark.parametrize("stage", ["kv_cache", "fused"])
def test_verify_step_gives_full_forward_logits_then_rolls_back(engines, prompts, stage):
    """Prefill, then k+1 new tokens over the cache in one forward (what speculative decoding's
    verify does): each position's logits equal a plain full forward's. Then accept only part of
    them and go on from there: the rejected slots hold stale keys, and nothing is recomputed."""
    model = engines(stage).model
    ids = prompts[1] + [1000, 2000, 3000, 4000, 5000]
    full = model(torch.tensor([ids]))[0]  # (seq, vocab), no cache
    p, k = len(prompts[1]), 5
    cache = make_cache(model, 1, 128)
    x = torch.tensor([ids])
    model(x[:, :p], slots(0, p), cache.layers(), slots(0, p), kv_len=p)
    verify = model(x[:, p:], slots(p, k), cache.layers(), slots(p, k), kv_len=p + k)[0]
    torch.testing.assert_close(verify, full[p:], rtol=0, atol=1e-4)
    # the same verify through the fixed-shape form: whole buffer, mask by slot
    fixed = model(x[:, p:], slots(p, k), cache.layers(), slots(p, k), torch.ones(1, 128, dtype=torch.bool))[0]
    torch.testing.assert_close(fixed, full[p:], rtol=0, atol=1e-4)
    # accept 2 of the 5: the next token goes at slot p + 2, over stale slots p+2..p+4
    other = [777]
    want = model(torch.tensor([ids[: p + 2] + other]))[0, -1]
    got = model(torch.tensor([other]), slots(p + 2, 1), cache.layers(), slots(p + 2, 1), kv_len=p + 3)[0, -1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    got = model(torch.tensor([other]), slots(p + 2, 1), cache.layers(), slots(p + 2, 1),
                torch.ones(1, 128, dtype=torch.bool))[0, -1]  # fixed shape: the mask hides slots p+3, p+4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_rows_of_a_batch_can_sit_at_different_slots(engines, prompts):
    """Ragged rows: each row writes and reads at its own slots (the basis of batched verify)."""
    model = engines("kv_cache").model
    a, b = prompts[0][:20], prompts[2][:27]
    cache = make_cache(model, 2, 64)
    for row, ids in enumerate((a, b)):  # fill each row's cache alone, via a one-row view of the buffers
        view = [KVLayer(layer.k[row:row + 1], layer.v[row:row + 1]) for layer in cache.layers()]
        model(torch.tensor([ids[:-1]]), slots(0, len(ids) - 1), view, slots(0, len(ids) - 1), kv_len=len(ids) - 1)
    last = torch.tensor([[a[-1]], [b[-1]]])
    pos = torch.tensor([[len(a) - 1], [len(b) - 1]])
    valid = torch.ones(2, 64, dtype=torch.bool)
    out = model(last, pos, cache.layers(), pos, valid)[:, -1]
    for row, ids in enumerate((a, b)):
        torch.testing.assert_close(out[row], model(torch.tensor([ids]))[0, -1], rtol=0, atol=1e-4)


def test_one_position_at_a_time_equals_all_at_once(engines, prompts):
    """Autoregressive is not sequential: a known sequence's logits come out the same whether its
    positions run in one forward (prefill) or one per forward through the cache (decode)."""
    from engine_lib.step.naive import stepwise_logits

    model = engines("kv_cache").model
    ids = prompts[3]
    torch.testing.assert_close(stepwise_logits(model, ids), model(torch.tensor([ids]))[0], rtol=0, atol=1e-4)
