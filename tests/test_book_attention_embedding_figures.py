"""engine_lib/book/attention_figures.py and embedding_figures.py: the pictures of chapters 02 and 03
show what the engine's own layers compute, on the trained preset."""

import pytest
import torch
from safetensors import safe_open

from engine_lib.book.attention_figures import (
    attention_heatmap,
    attention_probs,
    head_stats,
    pick_heads,
    record_attention,
    token_labels,
)
from engine_lib.book.embedding_figures import nearest_tokens, neighbours_figure, single_token_ids
from engine_lib.model.checkpoints import STDLIB_SMALL, ensure_checkpoint
from engine_lib.model.layers.attention import explicit_attention
from engine_lib.model.loader import load_model
from engine_lib.model.tokenizer import load_tokenizer

SNIPPET = "def add(self, item):\n    if item not in self.items:\n        self.items.append(item)\n    return self\n"


@pytest.fixture(scope="module")
def trained():
    path = ensure_checkpoint(STDLIB_SMALL)
    return load_model(path, torch.float32, torch.device("cpu")).eval(), load_tokenizer(path)


def test_probs_times_values_is_the_engines_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 16, generator=g), torch.randn(1, 2, 6, 16, generator=g), torch.randn(1, 2, 6, 16, generator=g)
    p = attention_probs(q, k, None, causal=True)  # (1, 4, 6, 6)
    assert torch.allclose(p @ v.repeat_interleave(2, 1), explicit_attention(q, k, v, None, True), atol=1e-6)
    assert p.triu(1).abs().max() == 0


def test_recorded_weights_rebuild_each_layers_output(trained):
    """Weights @ values through o_proj must equal what the layer returned: RoPE, GQA and the mask all match."""
    model, tok = trained
    ids = tok.encode(SNIPPET)
    seen = {}

    def keep(i):
        def hook(attn, args, out):
            seen[i] = (args[0], out)
        return hook

    hooks = [layer.self_attn.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    with torch.inference_mode():
        before = model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    probs = record_attention(model, ids)
    assert probs.shape == (4, 4, len(ids), len(ids))
    for i, layer in enumerate(model.model.layers):
        x, out = seen[i]
        _, _, v = layer.self_attn._project(x)  # (1, kv_heads, seq, head_dim)
        mixed = probs[i][None] @ v.repeat_interleave(2, 1)  # (1, heads, seq, head_dim)
        rebuilt = layer.self_attn.o_proj(mixed.transpose(1, 2).reshape(1, len(ids), -1))
        assert torch.allclose(rebuilt, out, atol=1e-5), i
    with torch.inference_mode():  # the hooks are gone: the model computes what it did before
        assert torch.equal(model(torch.tensor([ids])), before)


def test_head_stats_and_the_pick():
    seq = 5
    shift = torch.zeros(seq, seq)
    shift[0, 0] = 1
    shift[torch.arange(1, seq), torch.arange(seq - 1)] = 1  # every query on the previous token
    first = torch.zeros(seq, seq)
    first[:, 0] = 1  # every query on the first token
    probs = torch.stack([torch.stack([first, first]), torch.stack([first, shift])])  # (layers 2, heads 2, seq, seq)
    stats = head_stats(probs)
    assert stats["previous"][1, 1] == 1 and stats["first"][0, 0] == 1 and stats["entropy_bits"].abs().max() == 0
    assert pick_heads(probs) == (1, [1, 0])


def test_the_trained_model_has_a_previous_token_head(trained):
    """A trained preset, not noise: some head puts a large share of its weight on the previous token."""
    model, tok = trained
    probs = record_attention(model, tok.encode(SNIPPET))
    layer, heads = pick_heads(probs)
    assert head_stats(probs)["previous"][layer, heads[0]] > 0.3
    fig = attention_heatmap(probs, token_labels(tok, tok.encode(SNIPPET)), layer, heads, "qwen2-stdlib-small", "CPU")
    titles = " ".join(ax.get_title() for ax in fig.axes)
    assert f"layer {layer}, head {heads[0]}" in titles and "qwen2-stdlib-small" in fig._suptitle.get_text()
    assert fig.get_figwidth() <= 8


def test_nearest_is_by_cosine_and_leaves_the_token_out():
    table = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 0.0], [10.0, 9.0], [-1.0, 0.0]])
    near = nearest_tokens(table, 0, 4)
    assert [i for i, _ in near] == [1, 3, 2, 4]  # the long row ranks by angle, the zero row scores 0
    assert near[2][1] == 0 and all(i != 0 for i, _ in near)
    assert [i for i, _ in nearest_tokens(table, 0, 2, rows=3)] == [1, 2]


def test_trained_neighbours_make_sense():
    path = ensure_checkpoint(STDLIB_SMALL)
    tok = load_tokenizer(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight").float()
    near = {tok.decode([i]) for i, _ in nearest_tokens(table, tok.encode(" None")[0], 3, rows=len(tok))}
    assert {" True", " False"} <= near
    digits = {tok.decode([i]) for i, _ in nearest_tokens(table, tok.encode("1")[0], 5, rows=len(tok))}
    assert digits <= set("0123456789")
    with pytest.raises(ValueError):
        single_token_ids(tok, ["not one token at all"])
    fig = neighbours_figure(table, tok, ["def", " None"], "qwen2-stdlib-small")
    assert fig.get_figwidth() <= 8 and "qwen2-stdlib-small" in fig._suptitle.get_text()
