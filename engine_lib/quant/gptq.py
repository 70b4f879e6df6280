"""GPTQ: int4 weights chosen with calibration data, in the same format as round-to-nearest.

Defined in chapter 10. Frantar, Ashkboos, Hoefler, Alistarh (2022), "GPTQ: Accurate
Post-Training Quantization for Generative Pre-trained Transformers", arXiv:2210.17323.

Round-to-nearest rounds every weight on its own. GPTQ rounds the inputs of a layer one at a
time and, after each, moves the not-yet-rounded weights of the same output row to cancel the
error it made, as seen by the layer's real inputs X: it minimises ``||X W^T - X W_q^T||^2``,
whose curvature is ``H = 2 X^T X`` (gathered over calibration tokens). The algorithm, as the
paper gives it:

- H is damped (``damp`` = 1% of its mean diagonal added to the diagonal), and inputs that never
  fire (a zero diagonal) get weight 0;
- the updates use the upper Cholesky factor of H^-1, a block of ``block`` columns at a time
  (lazy batch updates: inside the block column by column, the rest of the row once per block);
- groups: a group's scale and zero are computed from the current, error-updated weights when
  its first column is reached (``act_order=False``). With ``act_order=True`` the columns go in
  order of decreasing H diagonal and the group grids are fixed up front from the original
  weights ("static groups"), so a group is still a run of ``group_size`` consecutive inputs;
- layers are quantized in order, each seeing the inputs that the already-quantized layers
  before it produce: within a block, q/k/v, then o, then gate/up, then down ("true sequential").

The result is the same int4 format as ``quant.quantize_int4`` (a scale and zero per group of
``group_size`` inputs of each output row, ``int4_grid``), written into the engine's existing
``QuantLinear`` layers with ``set_int4_``: the same packed kernels run, at the same speed.

Design: the loader quantizes each tensor as it reads it and never holds the full-precision
model, but GPTQ needs it (it runs the calibration forward layer by layer). So GPTQ is a second
step on an engine loaded at the int4 rung: ``quantize_engine_gptq(engine, calibration)`` loads a
full-precision copy of the same checkpoint with the same layout (fp32 by default), quantizes
it layer by layer and overwrites each ``QuantLinear``'s integers, then drops the copy. Peak
memory is the int4 engine plus the full-precision copy plus the calibration activations.
``Engine.from_pretrained(..., stage="int4", quant_method="gptq", calibration=...)`` does both.
The LM head is quantized with GPTQ too (its inputs are the final norm's outputs), as every
int4 layer is; ``head="rtn"`` keeps round-to-nearest there.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .formats import dequantize_int4, int4_grid
from .linear import QuantLinear

DAMP = 0.01  # fraction of H's mean diagonal added to its diagonal
BLOCK = 128  # columns per lazy batch update
ROW_CHUNK = 1 << 25  # weight elements worked on at once (rows are independent given H)
# the linear layers of a decoder block, in the order GPTQ quantizes them (packed or separate)
SEQUENCE = (("self_attn.qkv_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("self_attn.o_proj",), ("mlp.gate_up_proj", "mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


@dataclass
class GPTQResult:
    """What the calibration cost and how much output error it left, per layer."""

    calibration_sequences: int
    calibration_tokens: int
    seconds: float
    act_order: bool
    damp: float
    block: int
    head: str  # "gptq" or "rtn"
    source_dtype: str
    # per layer: GPTQ's and round-to-nearest's output error on the calibration inputs,
    # sum over rows of (w - w_q) H (w - w_q)^T / 2, i.e. ||X W^T - X W_q^T||^2 / n_tokens
    layer_error: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        g = sum(v["gptq"] for v in self.layer_error.values())
        r = sum(v["rtn"] for v in self.layer_error.values())
        return (f"GPTQ on {self.calibration_sequences} sequences, {self.calibration_tokens} calibration tokens, "
                f"{self.seconds:.1f} s (act_order={self.act_order}, damp={self.damp}, head={self.head}); "
                f"summed layer output error {g:.4g} vs round-to-nearest {r:.4g}")


def _quantize_column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (rows,) on the grid of stored scale s and zero z (rows,): (levels uint8, dequantized fp32)."""
    sf, zf = s.float(), z.float()
    q = ((w - (zf - 8 * sf)) / sf).round_().clamp_(0, 15)
    return q, (q - 8) * sf + zf


@torch.no_grad()
def quantize_int4_gptq(w: torch.Tensor, H: torch.Tensor, group_size: int, dtype: torch.dtype = torch.bfloat16,
                  block: int = BLOCK, damp: float = DAMP, act_order: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One (out, in) weight and its inputs' H (in, in) -> levels q uint8 (out, in), scales and zeros
    (out, in // group_size) in ``dtype``: ``quantize_int4``'s format, chosen by GPTQ."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    block = max(group_size, block // group_size * group_size)  # a group never straddles two blocks
    dev = w.device
    H = H.to(dev, torch.float32, copy=True)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k, device=dev)
    H = H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, device=dev)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    groups = k // group_size
    q_out = torch.empty(n, k, dtype=torch.uint8, device=dev)
    scales = torch.empty(n, groups, dtype=dtype, device=dev)
    zeros = torch.empty(n, groups, dtype=dtype, device=dev)
    group_of = (perm // group_size)  # group of each (permuted) column
    for a in range(0, n, max(1, ROW_CHUNK // k)):
        b = min(n, a + max(1, ROW_CHUNK // k))
        W = w[a:b].to(torch.float32, copy=True)
        W[:, dead] = 0
        if act_order:  # static groups: every grid from the original weights, fixed before any update
            lo, hi = torch.aminmax(W.view(b - a, groups, group_size), dim=-1)
            scales[a:b], zeros[a:b] = int4_grid(lo, hi, dtype)
        W = W[:, perm]
        Q = torch.empty(b - a, k, dtype=torch.uint8, device=dev)
        for i1 in range(0, k, block):
            i2 = min(i1 + block, k)
            W1, Err1, Hinv1 = W[:, i1:i2].clone(), torch.empty(b - a, i2 - i1, device=dev), hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                g = int(group_of[col])
                if not act_order and col % group_size == 0:  # a group starts: its grid from the updated weights
                    lo, hi = torch.aminmax(W1[:, i:i + group_size], dim=1)
                    scales[a:b, g], zeros[a:b, g] = int4_grid(lo, hi, dtype)
                lv, deq = _quantize_column(W1[:, i], scales[a:b, g], zeros[a:b, g])
                Q[:, col] = lv.to(torch.uint8)
                err = (W1[:, i] - deq) / Hinv1[i, i]
                W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
                Err1[:, i] = err
            W[:, i2:] -= Err1 @ hinv[i1:i2, i2:]
        q_out[a:b, perm] = Q
    return q_out, scales, zeros


def output_error(w: torch.Tensor, w_q: torch.Tensor, H: torch.Tensor) -> float:
    """sum over rows of (w - w_q) H (w - w_q)^T / 2: ||X W^T - X W_q^T||^2 / n when H = 2 X^T X / n."""
    d = (w.float() - w_q.float()).to(H.device)
    return float(((d @ H) * d).sum() / 2)


class _Hessian:
    """Running ``2 X^T X / n`` of a layer's inputs, fed by a forward pre-hook."""

    def __init__(self, k: int, device: torch.device):
        self.H = torch.zeros(k, k, device=device)
        self.n = 0

    def __call__(self, module, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        t = x.shape[0]
        self.H *= self.n / (self.n + t)
        self.n += t
        x = x * (2 / self.n) ** 0.5
        self.H += x.t() @ x


def _block_step(layer, x, residual, ctx, fused: bool):
    if fused:
        return layer.fused_forward(x, residual, ctx)
    return layer(x, ctx), None


@torch.no_grad()
def quantize_engine_gptq(engine, calibration, act_order: bool = False, damp: float = DAMP, block: int = BLOCK,
                         head: str = "gptq", source_dtype: torch.dtype = torch.float32, progress: bool = False,
                         keep_levels: dict | None = None) -> GPTQResult:
    """Replace the integer weights of an int4 engine with GPTQ's, from ``calibration``: a list of
    token-id sequences (see ``calibration_ids``). Returns the cost and the per-layer errors.
    ``keep_levels``: a dict that receives each layer's (q, scales, zeros), on the CPU, by name
    (what ``bench.quant_check`` checks the engine's kernels against)."""
    model = engine.model
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not quantized or any(m.mode != "int4" for m in quantized.values()):
        raise ValueError("GPTQ needs an engine at the int4 rung")
    if head not in ("gptq", "rtn"):
        raise ValueError(f"head must be 'gptq' or 'rtn', got {head!r}")
    seqs = [torch.as_tensor(s, dtype=torch.long).flatten().to(engine.device) for s in calibration]
    seqs = [s for s in seqs if s.numel() > 0]
    if not seqs:
        raise ValueError("GPTQ needs calibration token sequences")
    t0 = time.perf_counter()
    src = engine.unquantized(source_dtype)  # the checkpoint's own weights, which GPTQ rounds layer by layer
    result = GPTQResult(len(seqs), sum(s.numel() for s in seqs), 0.0, act_order, damp, block, head,
                        str(source_dtype).removeprefix("torch."))

    def do(name: str, lin: nn.Linear, H: torch.Tensor) -> None:
        target = quantized[name]
        q, s, z = quantize_int4_gptq(lin.weight, H, target.group_size, model.dtype, block, damp, act_order)
        deq = dequantize_int4(q, s, z)
        rtn = dequantize_int4(*_rtn(lin.weight, model.dtype, target.group_size))
        result.layer_error[name] = {"gptq": output_error(lin.weight, deq, H), "rtn": output_error(lin.weight, rtn, H)}
        target.set_int4_(q, s, z)
        if keep_levels is not None:
            keep_levels[name] = (q.cpu(), s.cpu(), z.cpu())
        lin.weight.copy_(deq)  # later layers see this layer quantized

    states = _quantize_blocks(src, seqs, do, progress)
    if isinstance(model.lm_head, QuantLinear):
        _quantize_head(src, model, states, head, do, result, keep_levels)
    del src, states
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
        torch.cuda.empty_cache()
    result.seconds = time.perf_counter() - t0
    engine.quant_method, engine.gptq = "gptq", result
    return result


def _quantize_blocks(src, seqs: list[torch.Tensor], do, progress: bool) -> list:
    """Every decoder block in order: gather each step's Hessian from the calibration activations (the layers
    of one step share their input), quantize its layers (``do``), then move the activations through the
    quantized block. -> the activations after the last block, one (x, residual) per sequence."""
    from tqdm.auto import tqdm

    dev, fused = src.device, src.fused
    ctxs, states = [], []
    for ids in seqs:
        ids = ids.view(1, -1)
        positions = torch.arange(ids.shape[1], device=dev).view(1, -1)
        ctxs.append(src.step_context(ids, positions, None, None, None, None))
        x = src.model.embed_tokens(ids)
        states.append((x.to(src.residual_dtype) if src.residual_dtype is not None else x, None))
    for i, layer in enumerate(tqdm(src.model.layers, desc="GPTQ", unit="layer", disable=not progress)):
        for names in SEQUENCE:
            present = [n for n in names if _has(layer, n)]
            if not present:
                continue
            hessians = {n: _Hessian(layer.get_submodule(n).in_features, dev) for n in present[:1]}
            hook = layer.get_submodule(present[0]).register_forward_pre_hook(hessians[present[0]])
            try:
                for (x, r), ctx in zip(states, ctxs):
                    _block_step(layer, x, r, ctx, fused)
            finally:
                hook.remove()
            H = hessians[present[0]].H
            for n in present:
                do(f"model.layers.{i}.{n}", layer.get_submodule(n), H)
        states = [_block_step(layer, x, r, ctx, fused) for (x, r), ctx in zip(states, ctxs)]
    return states


def _quantize_head(src, model, states: list, head: str, do, result: GPTQResult, keep_levels: dict | None) -> None:
    """The LM head, from the final norm's outputs: GPTQ's integers, or (``head="rtn"``) the loader's
    round-to-nearest ones kept, with their error recorded for comparison."""
    final = [src.model.norm(x + r if r is not None else x) for x, r in states]
    H = _Hessian(src.lm_head.in_features, src.device)
    for f in final:
        H(None, (f,))
    if head == "gptq":
        do("lm_head", src.lm_head, H.H)
        return
    levels = _rtn(src.lm_head.weight, model.dtype, model.lm_head.group_size)
    e = output_error(src.lm_head.weight, dequantize_int4(*levels), H.H)
    result.layer_error["lm_head"] = {"gptq": e, "rtn": e}
    if keep_levels is not None:
        keep_levels["lm_head"] = tuple(t.cpu() for t in levels)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def _rtn(w: torch.Tensor, dtype: torch.dtype, group_size: int):
    from .formats import quantize_int4

    return quantize_int4(w, dtype, group_size)


def calibration_ids(tokenizer, text: str, n_tokens: int = 4096, seq_len: int = 512) -> list[list[int]]:
    """The first ``n_tokens`` tokens of ``text`` (no chat template, no BOS), cut into sequences of
    ``seq_len``: GPTQ's calibration data (the paper: 128 sequences of 2048 tokens of C4)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return [ids[a:a + seq_len] for a in range(0, len(ids), seq_len) if len(ids[a:a + seq_len]) > 1]
