"""Every exercise check passes a right answer and fails a deliberately wrong one with a message
that names what differs (shape, dtype, first wrong element, ...). The worked solutions in
solutions/*.ipynb run the same checks under nbmake; here each check is proven able to fail.

The answers below are short on purpose: they are test inputs, not the book's solutions.
"""

import json
import math
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_lib.cache.contiguous import KVCache
from engine_lib.exercises import CHAPTERS, check, checks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import add_exercises  # noqa: E402


# ---------------------------------------------------------------- right answers
def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ttft_and_rate(start, arrivals):
    n = len(arrivals)
    return arrivals[0] - start, (n - 1) / (arrivals[-1] - arrivals[0]) if n > 1 else float("nan")


def token_bytes(tok, ids):
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in kept]
    dec = {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(others)}
    special = set(tok.added_tokens_decoder)
    return [p.encode() if i in special else bytes(dec[c] for c in p) for i, p in zip(ids, tok.convert_ids_to_tokens(ids))]


def chatml(messages):
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."},
                    *messages]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def rms_norm(x, w, eps):
    f = x.float()
    return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(w.dtype)


def num_parameters(cfg):
    h, i, d, kv = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    del d
    return cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_hidden_layers * layer + h


def read_header(path):
    with open(path, "rb") as f:
        raw = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    raw.pop("__metadata__", None)
    return raw


def compute_bound_from(cfg, ridge, b, head_every_token=False):
    h, L, p = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_parameters()
    head = cfg.vocab_size * h
    for t in range(1, cfg.max_position_embeddings + 1):
        flops = 2 * (p - head - h) * t + 2 * head * (t if head_every_token else 1) + L * 4 * h * t * (t + 1) // 2
        if flops / (p * b) >= ridge:
            return t
    return None


def nearest(table, i, k, dot=False):
    t = table.float()
    u = t if dot else t / t.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    s = u @ u[i]
    s[i] = -float("inf")
    return s.topk(k).indices.tolist()


def bucket_cost(engine, prompts, n, bucket, derive=False):
    import engine_lib.loop.local as local

    old, local.CACHE_BUCKET = local.CACHE_BUCKET, bucket
    try:
        allocations, unused, cache, length = 0, 0, None, None
        for ids in prompts:
            if derive:  # the sizing rule, not the engine: misses a fixed context
                new = -(-(len(ids) + n) // bucket) * bucket
                allocations, length = allocations + (new != length), new
                unused += new - len(ids) - n
                continue
            engine.generate(ids, max_new_tokens=n, do_sample=False, stop_token_ids=[])
            now = engine.loop.cache
            allocations, cache = allocations + (now is not cache), now
            unused += now.block_size - len(ids) - n
    finally:
        local.CACHE_BUCKET = old
    return allocations, unused


def half_error(path, dtype, residual_fp32, prompts):
    from engine_lib.model.loader import load_model
    from engine_lib.model.qwen2 import ModelOptions

    def first(dt, res):
        m = load_model(path, dt, torch.device("cpu"), ModelOptions(sdpa=True, residual_dtype=res))
        with torch.inference_mode():
            return [m(torch.tensor([ids]), last_only=True)[0, -1].float() for ids in prompts]

    ref, ours = first(torch.float32, None), first(dtype, torch.float32 if residual_fp32 else None)
    return max((a - b).abs().max().item() for a, b in zip(ours, ref))


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.outer(pos.float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def rope_interleaved(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.outer(pos.float(), inv).repeat_interleave(2, -1)
    rot = torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
    return x * ang.cos() + rot * ang.sin()


def causal_mask(q, s):
    return torch.ones(q, s, dtype=torch.bool).tril(s - q)


def gqa(q, k, v, mask_fn=causal_mask):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask_fn(q.shape[2], k.shape[2]), float("-inf"))
    return scores.float().softmax(-1) @ v


def swiglu(x, g, u, d, act=F.silu):
    return F.linear(act(F.linear(x, g)) * F.linear(x, u), d)


def greedy(model, ids, n, pick=-1):
    x, out = torch.tensor([ids]), []
    for _ in range(n):
        t = int(model(x)[0, pick].argmax())
        out.append(t)
        x = torch.cat([x, torch.tensor([[t]])], 1)
    return out


def _cache(model, n):
    c = model.config
    return KVCache(c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim, n, model.dtype, model.device)


def cached_greedy(model, ids, n, slot_shift=0):
    t = len(ids)
    cache = _cache(model, t + n)
    pos = torch.arange(t)[None]
    tok = int(model(torch.tensor([ids]), pos, cache.layers(), pos, kv_len=t)[0, -1].argmax())
    out = [tok]
    for p in range(t, t + n - 1):
        pp = torch.tensor([[p]])
        tok = int(model(torch.tensor([[tok]]), pp, cache.layers(), pp + slot_shift, kv_len=p + 1)[0, -1].argmax())
        out.append(tok)
    return out


def verify_logits(model, prompt, tokens, pos_shift=0):
    t, k = len(prompt), len(tokens)
    cache = _cache(model, t + k)
    pos = torch.arange(t)[None]
    model(torch.tensor([prompt]), pos, cache.layers(), pos, kv_len=t)
    pos = torch.arange(t, t + k)[None]
    return model(torch.tensor([tokens]), pos + pos_shift, cache.layers(), pos, kv_len=t + k)[0]


def round_to_bf16(x, truncate=False):
    i = x.view(torch.int32)
    if not truncate:
        i = i + 0x7FFF + ((i >> 16) & 1)
    return (i & -65536).view(torch.float32)


def add_rms_norm(x, r, w, eps):
    s = x + r
    return rms_norm(s, w, eps), s


def rope_(x, cos, sin):
    h = x.shape[-1] // 2
    x1, x2, c, s = x[..., :h], x[..., h:], cos[..., :h], sin[..., :h]
    r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
    x1.copy_(r1)
    x2.copy_(r2)
    return x


def top_p_filter(logits, p, strict=False):
    probs, idx = logits.softmax(-1).sort(-1, descending=True)
    before = probs.cumsum(-1) - probs
    drop = (probs.cumsum(-1) > p) if strict else (before >= p)
    drop_full = torch.zeros_like(drop).scatter(-1, idx, drop)
    return logits.masked_fill(drop_full, float("-inf"))


def repetition_penalty(logits, seen, penalty, divide_all=False):
    out = logits.clone()
    for r, ids in enumerate(seen):
        for t in set(ids):
            v = out[r, t]
            out[r, t] = v / penalty if (divide_all or v > 0) else v * penalty
    return out


def pad_left(prompts, pad, right=False):
    n = max(map(len, prompts))
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    valid = torch.zeros(len(prompts), n, dtype=torch.bool)
    for r, p in enumerate(prompts):
        sl = slice(0, len(p)) if right else slice(n - len(p), n)
        ids[r, sl], valid[r, sl] = torch.tensor(p, dtype=torch.long), True
    return ids, valid


def quantize_int8(w, axis=1):
    s = (w.abs().amax(axis) / 127).clamp_min(1e-30)
    s_b = s[:, None] if axis == 1 else s[None, :]
    return (w / s_b).round().clamp(-127, 127).to(torch.int8), s


def dequantize_int4(q, s, z, offset=8):
    n, k = q.shape
    g = s.shape[1]
    return ((q.float().view(n, g, k // g) - offset) * s.float()[..., None] + z.float()[..., None]).view(n, k)


def lookup(context, k, max_ngram=3, earliest=False):
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        starts = range(len(context) - n - 1, -1, -1)
        for start in (reversed(starts) if earliest else starts):
            if context[start:start + n] == tail and context[start + n:start + n + k]:
                return context[start + n:start + n + k]
    return []


def accept_greedy(logits, draft, count_all=False):
    target = logits.argmax(-1).tolist()
    hits = [a == b for a, b in zip(draft, target)]
    acc = sum(hits) if count_all else next((i for i, h in enumerate(hits) if not h), len(draft))
    return acc, target[acc]


def expected_tokens(a, k):
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


class Allocator:
    def __init__(self, num_blocks, partial=False):
        self.free_ids, self.partial = list(range(2, num_blocks)), partial

    @property
    def num_free(self):
        return len(self.free_ids)

    def allocate(self, n):
        if n > len(self.free_ids) and not self.partial:
            raise RuntimeError("out of blocks")
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        if len(out) < n:
            raise RuntimeError("out of blocks")  # too late: it already took what there was
        return out

    def free(self, blocks):
        self.free_ids += blocks


def physical_slots(table, pos, bs):
    return table.gather(1, pos // bs) * bs + pos % bs


def max_requests(cfg, gib, nbytes, tokens, reserved=2):
    per_block = 16 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * nbytes
    return (int(gib * 2**30) // per_block - reserved) // math.ceil(tokens / 16)


def cached_tokens(a, b, bs, last_rule=True):
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(common, len(b) - 1 if last_rule else len(b)) // bs * bs


def triton_rmsnorm(x, w, eps):
    from engine_lib.kernels.add_rmsnorm import rmsnorm  # a Triton kernel (the interpreter on a CPU)

    return rmsnorm(x, w, eps)


def rmsnorm_over_block(x, w, eps):
    """The classic Triton slip: the mean of squares taken over the padded power-of-two block."""
    f = x.float()
    block = 1 << (x.shape[-1] - 1).bit_length()
    return w * (f * torch.rsqrt(f.pow(2).sum(-1, keepdim=True) / block + eps)).to(w.dtype)


def decode_ops(stage, whole_call=False):
    from engine_lib import Engine
    from engine_lib.bench.measure import top_level_ops
    from engine_lib.loop.local import LocalLoop
    from engine_lib.model.checkpoints import ensure_checkpoint
    from engine_lib.sampling import SamplingParams

    engine = Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", stage=stage, dtype=torch.float32)
    loop = LocalLoop(engine.model, engine.tokenizer, engine.max_model_len)
    paused = loop.paused([list(range(1000, 1012))], SamplingParams(max_tokens=8))
    paused.decode()
    if whole_call:  # the prefill counted too
        return top_level_ops(lambda: loop.paused([list(range(1000, 1012))], SamplingParams(max_tokens=8)).decode())
    return top_level_ops(paused.decode)


def measured_intensity(stage, batch, per_param=False):
    from torch.utils.flop_counter import FlopCounterMode

    from engine_lib import Engine
    from engine_lib.bench.measure import weight_bytes
    from engine_lib.model.checkpoints import ensure_checkpoint

    engine = Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", stage=stage)
    paused = engine.loop.paused([list(range(1000, 1016))] * batch, engine.sampling(do_sample=False, max_tokens=2))
    with FlopCounterMode(display=False) as fc:
        paused.decode()
    params = sum(p.numel() for p in engine.model.parameters())
    return fc.get_total_flops() / (params if per_param else weight_bytes(engine.model))


def kv_bytes(engine, batch, prompt_len, new_tokens, formula=False):
    if formula:  # chapter 05's formula without the runner's buckets
        c = engine.config
        return 2 * c.num_hidden_layers * batch * c.num_key_value_heads * c.head_dim * (prompt_len + new_tokens) * 4
    engine.generate_batch([[1000] * prompt_len] * batch, max_new_tokens=new_tokens, do_sample=False,
                          stop_token_ids=[])
    return engine.kv_cache_bytes


def group_size_effect(weight, x, g, forget_scales=False):
    from engine_lib.quant.linear import QuantLinear

    layer = QuantLinear(weight.shape[1], weight.shape[0], mode="int4", group_size=g)
    layer.quantize_(weight, torch.bfloat16)
    stored = layer.qweight.numel() * layer.qweight.element_size()
    if not forget_scales:
        stored += layer.scales_and_zeros.numel() * layer.scales_and_zeros.element_size()
    want = x.float() @ weight.float().t()
    with torch.no_grad():
        got = layer(x.to(torch.bfloat16)).float()
    return stored / weight.numel(), ((got - want).norm() / want.norm()).item()


def target_forwards(engine, prompt_ids, drafter, max_k, new_tokens, verifies_only=False):
    from engine_lib import Engine

    spec = Engine(engine.model, engine.tokenizer, engine.model_dir, engine.stage, engine.device, speculative=drafter)
    got = spec.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False, stop_token_ids=[],
                        speculative_tokens=max_k)
    return got.extra["target_forwards"] - (1 if verifies_only else 0)


def score_continuation(logits, ids, ctxlen, shift=0):
    lp = logits.float().log_softmax(-1)[ctxlen - 1 + shift:len(ids) - 1 + shift]
    lp = lp[:len(ids) - ctxlen]
    want = torch.tensor(ids[ctxlen:])[:len(lp), None]
    return lp.gather(1, want).sum().item(), bool((lp.argmax(-1) == want[:, 0]).all())


RIGHT = {
    "ex00_1": first_difference,
    "ex00_2": ttft_and_rate,
    "ex00_3": compute_bound_from,
    "ex01_1": token_bytes,
    "ex01_2": lambda tok, text: sum("\ufffd" in tok.decode([i]) for i in tok.encode(text)),
    "ex01_3": chatml,
    "ex02_1": rms_norm,
    "ex02_2": nearest,
    "ex02_3": read_header,
    "ex03_1": rope,
    "ex03_2": causal_mask,
    "ex03_3": gqa,
    "ex04_1": swiglu,
    "ex04_2": greedy,
    "ex04_3": lambda lg: (lambda t: t[:, 0] - t[:, 1])(lg.float().topk(2, -1).values),
    "ex05_1": bucket_cost,
    "ex05_2": cached_greedy,
    "ex05_3": verify_logits,
    "ex06_1": round_to_bf16,
    "ex06_2": lambda cap: torch.bfloat16 if cap >= (8, 0) else torch.float16,
    "ex06_3": lambda q, k: (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2),
    "ex06_4": half_error,
    "ex07_1": add_rms_norm,
    "ex07_2": lambda q, k, v: torch.cat([q, k, v]),
    "ex07_3": rope_,
    "ex07_4": decode_ops,
    "ex08_1": lambda cfg, b, batch: 2 * batch / b,
    "ex08_2": lambda i, peak, bw: min(peak, i * bw),
    "ex08_3": lambda a, b: statistics.median(a) / statistics.median(b),
    "ex08_4": measured_intensity,
    "ex09_1": top_p_filter,
    "ex09_2": repetition_penalty,
    "ex09_3": pad_left,
    "ex09_4": kv_bytes,
    "ex10_1": quantize_int8,
    "ex10_2": lambda g: 0.5 + 4 / g,
    "ex10_3": dequantize_int4,
    "ex10_4": group_size_effect,
    "ex11_1": lookup,
    "ex11_2": accept_greedy,
    "ex11_3": expected_tokens,
    "ex11_4": target_forwards,
    "ex12_1": Allocator,
    "ex12_2": physical_slots,
    "ex12_3": max_requests,
    "ex13_1": cached_tokens,
    "ex13_2": score_continuation,
    "ex14_1": triton_rmsnorm,
    "ex14_2": lambda outs, lses: (torch.softmax(lses, 0)[..., None] * outs).sum(0),
    "ex14_3": lambda b, h, kvh, t, d, n, e: (2 * b * kvh * n + 2 * b * h * t) * d * e,
}

# a typical mistake per check, and words its verdict must contain
WRONG = {
    "ex00_1": (lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None), "a prefix"),
    "ex00_2": (lambda s, a: (a[0] - s, len(a) / (a[-1] - s)), "your decode rate is"),  # counts the first token
    "ex00_3": (lambda cfg, r, b: compute_bound_from(cfg, r, b, head_every_token=True),
               "your shortest compute-bound prompt"),  # the LM head on every prompt position
    "ex01_1": (lambda tok, ids: [tok.decode([i]).encode() for i in ids], "gives b'\\xef\\xbf\\xbd'"),
    "ex01_2": (lambda tok, text: len(tok.encode(text)) - len(text), "partial_tokens("),
    "ex01_3": (lambda m: chatml([x for x in m if x["role"] != "system"] or m)[len("<|im_start|>system\n"):],
               "the tokens part at token 0"),
    "ex02_1": (lambda x, w, eps: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), "float16 with values near 1,000"),
    "ex02_2": (lambda t, i, k: nearest(t, i, k, dot=True), "nearest rows to row"),  # dot product, not cosine
    "ex02_3": (lambda p: json.loads(open(p, "rb").read(8 + int.from_bytes(open(p, "rb").read(8), "little"))[8:]),
               "'__metadata__'"),
    "ex03_1": (rope_interleaved, "first difference at index"),
    "ex03_2": (lambda q, s: torch.ones(q, s, dtype=torch.bool).tril(), "4 new queries over 10 keys"),
    "ex03_3": (lambda q, k, v: gqa(q, k, v, lambda a, b: torch.ones(a, b, dtype=torch.bool).tril()),
               "a decode step"),
    "ex04_1": (lambda x, g, u, d: swiglu(x, g, u, d, F.relu), "first difference at index"),
    "ex04_2": (lambda m, ids, n: greedy(m, ids, n, pick=0), "the engine's greedy choice"),
    "ex04_3": (lambda lg: lg.float().max(-1).values - lg.float().mean(-1), "your margins"),  # gap to the mean
    "ex05_1": (lambda e, p, n, b: bucket_cost(e, p, n, b, derive=True), "fixed cache length"),  # not measured
    "ex05_2": (greedy, "each call should feed one token"),  # no cache at all
    "ex05_3": (lambda m, p, t: verify_logits(m, p, t, pos_shift=-1), "first difference at index"),  # off by one
    "ex06_1": (lambda x: round_to_bf16(x, truncate=True), "your rounded values: first difference"),
    "ex06_2": (lambda cap: torch.bfloat16 if torch.cuda.is_available() else torch.float16, "an A100"),
    "ex06_3": (lambda q, k: (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, "overflowed"),
    "ex06_4": (lambda d, dt, r, p: half_error(d, dt, not r, p), "your largest logit error"),  # residual swapped
    "ex07_1": (lambda x, r, w, eps: (rms_norm(x + r, w, eps), r), "your new residual"),
    "ex07_2": (lambda q, k, v: torch.cat([k, q, v]), "your packed weight"),
    "ex07_4": (lambda s: decode_ops(s, whole_call=True), "your count for 'kv_cache'"),  # counted the prefill
    "ex07_3": (lambda x, cos, sin: x * cos + torch.cat([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], -1) * sin,
               "returned a new tensor"),
    "ex08_1": (lambda cfg, b, batch: 2 / b, "batch 8"),  # forgot the batch
    "ex08_2": (lambda i, peak, bw: i * bw, "a big prefill"),  # no compute roof
    "ex08_3": (lambda a, b: statistics.mean(a) / statistics.mean(b), "one slow baseline run"),
    "ex08_4": (lambda s, b: measured_intensity(s, b, per_param=True), "your FLOPs per byte"),  # FLOPs per weight
    "ex09_1": (lambda x, p: top_p_filter(x, p, strict=True), "you dropped token"),
    "ex09_2": (lambda x, s, p: repetition_penalty(x, s, p, divide_all=True), "first difference at index [0, 1]"),
    "ex09_3": (lambda p, d: pad_left(p, d, right=True), "your ids"),
    "ex09_4": (lambda e, b, t, n: kv_bytes(e, b, t, n, formula=True), "your KV cache bytes"),  # no buckets
    "ex10_1": (lambda w: quantize_int8(w, axis=0), "one per output row"),  # wrong axis
    "ex10_2": (lambda g: 0.5, "your bytes per weight"),  # forgot scales and zeros
    "ex10_3": (lambda q, s, z: dequantize_int4(q, s, z, offset=0), "your weight: first difference"),
    "ex10_4": (lambda w, x, g: group_size_effect(w, x, g, forget_scales=True), "your bytes per weight (group 32)"),
    "ex11_1": (lambda c, k, n=3: lookup(c, k, n, earliest=True), "the latest occurrence wins"),
    "ex11_2": (lambda lg, d: accept_greedy(lg, d, count_all=True), "(accepted, next_token) for draft"),
    "ex11_3": (lambda a, k: 1 + a * k, "your expected tokens is"),  # linear, not geometric
    "ex11_4": (lambda e, p, d, k, n: target_forwards(e, p, d, k, n, verifies_only=True), "your target forwards"),
    "ex12_1": (lambda n: Allocator(n, partial=True), "refused allocation"),  # not all-or-nothing
    "ex12_2": (lambda t, p, bs: t.gather(1, p // bs) + p % bs, "your slots"),  # forgot * block_size
    "ex12_3": (lambda cfg, gib, b, t: max_requests(cfg, gib, b, t, reserved=0), "your number of requests"),
    "ex13_1": (lambda a, b, bs: cached_tokens(a, b, bs, last_rule=False), "last token's block"),  # matched it
    "ex13_2": (lambda lg, ids, c: score_continuation(lg, ids, c, shift=1), "your log-likelihood"),  # row i scores i
    "ex14_1": (rmsnorm_over_block, "hidden 96"),
    "ex14_2": (lambda o, lse: (lse.exp()[..., None] * o).sum(0) / lse.exp().sum(0)[..., None], "near 1,000"),
    "ex14_3": (lambda b, h, kvh, t, d, n, e: (2 * b * h * n + 2 * b * h * t) * d * e, "your byte count"),  # K/V per query head
}

ALL = [name for ch in sorted(CHAPTERS) for name in (f.__name__ for f in checks(ch))]


def test_every_check_has_a_right_and_a_wrong_answer():
    assert sorted(ALL) == sorted(RIGHT) == sorted(WRONG)
    assert set(ALL) == set(check.__all__)
    for ch, mod in CHAPTERS.items():
        assert 2 <= len(mod.EXERCISES) <= 4, ch


@pytest.mark.parametrize("name", ALL)
def test_the_right_answer_passes(name, capsys):
    result = getattr(check, name)(RIGHT[name])
    out = capsys.readouterr().out
    assert result, result.message
    assert out.startswith("✓") and "agree with the engine" in out


@pytest.mark.parametrize("name", ALL)
def test_a_wrong_answer_fails_and_says_why(name, capsys):
    wrong, words = WRONG[name]
    result = getattr(check, name)(wrong)
    out = capsys.readouterr().out
    assert not result, f"{name} passed a wrong answer"
    assert out.startswith("✗") and "not yet" in out and "Hint:" in out
    assert words in result.message, result.message
    assert "Traceback" not in out and "AssertionError" not in out


def test_a_crashing_answer_is_reported_not_raised(capsys):
    result = check.ex02_1(lambda x, w, eps: x.no_such_method())
    assert not result and "your code raised AttributeError" in result.message


@pytest.mark.parametrize("ch", sorted(CHAPTERS))
def test_chapter_exercise_cells_are_up_to_date(ch):
    """scripts/add_exercises.py was run: each chapter's Exercises cell is the text in the module."""
    nb_path = add_exercises.chapter_path(ch)
    nb = json.loads(nb_path.read_text())
    cells = ["".join(c["source"]) for c in nb["cells"]]
    assert add_exercises.exercises_markdown(ch) in cells, f"{nb_path.name}: run python scripts/add_exercises.py"
    i = cells.index(add_exercises.exercises_markdown(ch))
    assert cells[i + 1] == add_exercises.IMPORT_CELL
    assert len(re.findall(r"check\.ex\d\d_\d", cells[i])) == len(CHAPTERS[ch].EXERCISES)


@pytest.mark.parametrize("ch", sorted(CHAPTERS))
def test_each_chapter_has_a_solutions_notebook_that_runs_every_check(ch):
    path = ROOT / "solutions" / f"{CHAPTERS[ch].SOLUTIONS}.ipynb"
    code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    for fn in checks(ch):
        assert f"check.{fn.__name__}(" in code, f"{path.name} does not run {fn.__name__}"


SOLUTION_NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", SOLUTION_NOTEBOOKS, ids=lambda p: p.stem)
def test_solution_notebooks_are_clean_listed_and_open_in_colab(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), f"{path.name} has outputs"
    url = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", (ROOT / "_config.yml").read_text(), re.MULTILINE).group(1)
    first = "".join(nb["cells"][0]["source"])
    assert f"colab.research.google.com/github/{url.removeprefix('https://github.com/')}/blob/main/solutions/" \
           f"{path.name}" in first
    install = next(c for c in code if "google.colab" in "".join(c["source"]))
    assert f"git+{url}" in "".join(install["source"]) and "skip-execution" in install["metadata"]["tags"]
    assert f"file: solutions/{path.stem}\n" in (ROOT / "_toc.yml").read_text(), f"{path.name} is not in _toc.yml"
    assert f"../chapters/{path.name}" in first, f"{path.name} does not link its chapter"


SITE = ROOT / "_build" / "html"


@pytest.mark.skipif(not (SITE / "solutions" / "05_kv_cache.html").is_file(), reason="the site is not built")
@pytest.mark.parametrize("ch", sorted(CHAPTERS))
def test_the_site_styles_exercises_and_links_each_chapter_to_its_solutions(ch):
    stem = CHAPTERS[ch].SOLUTIONS
    page = (SITE / "chapters" / f"{stem}.html").read_text()
    boxes = re.findall(r'class="[^"]*\bexercise\b[^"]*admonition|class="[^"]*admonition[^"]*\bexercise\b', page)
    assert len(boxes) == len(CHAPTERS[ch].EXERCISES), f"{stem}: {len(boxes)} exercise boxes"
    assert f'href="../solutions/{stem}.html"' in page, f"{stem}: no link to its solutions page"
    solution = (SITE / "solutions" / f"{stem}.html").read_text()
    assert f'href="../chapters/{stem}.html"' in solution
    if "cell_output" in solution:  # built from executed notebooks: every check's verdict is on the page
        assert solution.count("✓ Exercise") == len(CHAPTERS[ch].EXERCISES), f"{stem}: a solution's check failed"


def test_add_exercises_rebuilds_the_cells_after_a_merge(tmp_path):
    """A merge that brought back the old exercises at the end of the summary, next to the new cells."""
    ch = "05"
    current = add_exercises.chapter_path(ch).read_text()
    nb = json.loads(current)
    summary = next(c for c in nb["cells"] if "## Summary" in "".join(c["source"]))
    summary["source"] = ["".join(summary["source"]) + "\n\n## Exercises\n\n1. An old exercise.\n2. Another.\n"]
    path = tmp_path / "merged.ipynb"
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    assert add_exercises.apply(ch, path)
    assert path.read_text() == current
    assert not add_exercises.apply(ch, path)  # idempotent


def test_the_exercises_ship_in_the_package():
    """Colab installs engine_lib with pip: the checks must be in the wheel, not only in the repository."""
    text = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"^packages = \[(.*?)\]", text, re.MULTILINE | re.DOTALL).group(1)
    assert '"engine_lib.exercises"' in packages
