"""Our Triton kernels beside the ops they replace, as time and GB/s against the copy roofline.

Defined in chapter 14 (writing our own kernels); run by ``scripts/gpu_check.sh`` (its
``kernels`` phase) and ``python -m engine_lib.bench.kernels``. Shapes are the real model's
(hidden 1,536, 12 query heads sharing 2 KV heads of 128, MLP 8,960) unless a config says
otherwise. Each row times one call of our kernel and one call of what the engine runs
without it, both on the same inputs, both checked equal first, and divides the kernel's
ideal bytes (its ``bytes_moved``) by the time: a bandwidth-bound kernel at the roofline reads
and writes at the device's measured copy bandwidth.

On a CPU the kernels run in Triton's interpreter, which executes each program in numpy:
its timings say nothing about a GPU, and the report says so instead of printing them.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from ..kernels import interpreter_reason, interpreting, unavailable_reason
from ..model.config import Qwen2Config
from ..stages import half_dtype, resolve_device
from .measure import copy_bandwidth, device_name
from .timing import measure

REAL_SHAPE = dict(hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960)


@dataclass
class KernelRow:
    kernel: str
    shape: str
    baseline: str  # what the engine runs without the kernel
    bytes: int  # the kernel's ideal traffic (bytes_moved)
    ours_us: float
    baseline_us: float
    max_abs_diff: float  # ours against the baseline, on the same inputs

    @property
    def speedup(self) -> float:
        return self.baseline_us / self.ours_us

    def gbps(self) -> float:
        return self.bytes / (self.ours_us * 1e-6) / 1e9


def shape_of(cfg: Qwen2Config | None) -> dict:
    if cfg is None:
        return dict(REAL_SHAPE)
    return dict(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, intermediate=cfg.intermediate_size)


def _time_us(fn, device) -> float:
    return measure(fn, device, warmup=3, min_total_s=0.1).median * 1e6


def _row(kernel, shape, baseline_name, nbytes, ours, baseline, device) -> KernelRow:
    """Check ours against the baseline once, then time both (not in the interpreter: numpy per program)."""
    a, b = ours(), baseline()
    diff = (a.float() - b.float()).abs().max().item()
    if interpreting():
        return KernelRow(kernel, shape, baseline_name, nbytes, float("nan"), float("nan"), diff)
    return KernelRow(kernel, shape, baseline_name, nbytes, _time_us(ours, device), _time_us(baseline, device), diff)


def norm_rows(s: dict, dtype, device, rows_list=(1, 8)) -> list[KernelRow]:
    from ..kernels.add_rmsnorm import add_rmsnorm_, bytes_moved
    from ..model.layers.rmsnorm import RMSNorm

    out = []
    norm = RMSNorm(s["hidden"]).to(device, dtype)
    for rows in rows_list:
        x = torch.randn(rows, s["hidden"], device=device, dtype=dtype)
        residual = torch.randn(rows, s["hidden"], device=device, dtype=dtype)
        r1, r2 = residual.clone(), residual.clone()
        # both add into their own copy of the residual: the time includes no clone
        ours = partial(add_rmsnorm_, x, r1, norm.weight, norm.eps)
        base = partial(lambda x, r: norm.add_forward(x, r)[0], x, r2)
        size = torch.tensor([], dtype=dtype).element_size()
        out.append(_row("add_rmsnorm", f"rows {rows} x {s['hidden']}", "torch add + RMSNorm (eager)",
                        bytes_moved(rows, s["hidden"], size, size, size), ours, base, device))
    return out


def rope_rows(s: dict, dtype, device, max_len: int = 4096) -> list[KernelRow]:
    from ..cache.contiguous import write_kv
    from ..kernels.rope_kv_write import bytes_moved, rope_kv_write_
    from ..model.layers.rope import RotaryEmbedding, apply_rope_

    h, kvh, d = s["heads"], s["kv_heads"], s["head_dim"]
    rope = RotaryEmbedding(d, max_len, 1e6).to(device)
    packed = torch.randn(1, 1, (h + 2 * kvh) * d, device=device, dtype=dtype)
    pos = torch.full((1, 1), max_len // 2, device=device, dtype=torch.long)
    rows = torch.zeros(1, 1, device=device, dtype=torch.long)

    def buffers():
        """A packed projection output split into q, k, v views, and an empty cache: one set per side."""
        qkv = packed.clone().view(1, 1, h + 2 * kvh, d).transpose(1, 2).split([h, kvh, kvh], dim=1)
        cache = torch.zeros(2, 1, kvh, max_len, d, device=device, dtype=dtype)
        return (*qkv, cache[0], cache[1])

    def ours(q, k, v, k_cache, v_cache):
        rope_kv_write_(q, k, v, pos, rope.cos_table, rope.sin_table, k_cache, v_cache, pos)
        return torch.cat([q.flatten(), k_cache[:, :, max_len // 2].flatten()])

    def base(q, k, v, k_cache, v_cache):
        cos, sin = rope(pos, dtype)
        apply_rope_(q, cos, sin), apply_rope_(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, rows, pos, None)
        return torch.cat([q.flatten(), k_cache[:, :, max_len // 2].flatten()])

    # each side rotates its own q in place on every call: compared after one call, then timed
    size = torch.tensor([], dtype=dtype).element_size()
    return [_row("rope_kv_write", f"1 token, {h}+{kvh} heads x {d}", "torch RoPE + cache write (eager)",
                 bytes_moved(1, h, kvh, d, size), partial(ours, *buffers()), partial(base, *buffers()), device)]


def attention_rows(s: dict, dtype, device, contexts=(64, 1024, 4096), batch: int = 1) -> list[KernelRow]:
    from ..cache.contiguous import visible_slots
    from ..kernels.decode_attention import bytes_moved, chunk_size, decode_attention, merge_bytes
    from ..model.layers.attention import sdpa_attention

    h, kvh, d = s["heads"], s["kv_heads"], s["head_dim"]
    out = []
    for ctx in contexts:
        buffer = -(-ctx // 256) * 256  # the engine's cache bucket
        q = torch.randn(batch, h, 1, d, device=device, dtype=dtype)
        k = torch.randn(batch, kvh, buffer, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
        pos = torch.full((batch, 1), ctx - 1, device=device, dtype=torch.long)
        mask = visible_slots(pos, None, buffer)  # (batch, 1, 1, buffer): what the fused rung's step passes
        size = torch.tensor([], dtype=dtype).element_size()

        def nbytes(span, ctx=ctx, size=size):
            """K, V, q, out, plus the split-KV partials of the chunks the context reaches (``span`` sets their size)."""
            live = -(-ctx // chunk_size(span, batch, kvh))
            return bytes_moved(batch, h, kvh, 1, d, ctx, size) + merge_bytes(batch, h, 1, d, live)

        label = f"batch {batch}, context {ctx}"
        out.append(_row("decode_attention", label, "SDPA over the buffer + mask (fused rung's step)", nbytes(buffer),
                        partial(decode_attention, q, k, v, pos, kv_len=buffer),
                        partial(sdpa_attention, q, k, v, mask, False), device))
        k_span, v_span = k[:, :, :ctx], v[:, :, :ctx]
        out.append(_row("decode_attention", label, "SDPA over the exact span (eager rungs)", nbytes(ctx),
                        partial(decode_attention, q, k, v, pos, kv_len=ctx),
                        partial(sdpa_attention, q, k_span, v_span, None, False), device))
    return out


def int8_rows(s: dict, dtype, device, rows_list=(1, 8)) -> list[KernelRow]:
    from ..kernels.int8_matvec import bytes_moved, int8_matvec
    from ..quant.linear import QuantLinear

    out = []
    shapes = [("gate_up", s["hidden"], 2 * s["intermediate"]), ("down", s["intermediate"], s["hidden"])]
    for name, n_in, n_out in shapes:
        layer = QuantLinear(n_in, n_out, mode="int8").to(device)
        layer.quantize_(torch.randn(n_out, n_in, device=device) * n_in**-0.5, dtype)
        step = torch.compile(layer.forward, dynamic=False) if device.type == "cuda" else layer.forward
        for rows in rows_list:
            x = torch.randn(rows, n_in, device=device, dtype=dtype)
            base_name = "the int8 rung's compiled matmul" if device.type == "cuda" else f"QuantLinear ({layer.kernel})"
            out.append(_row("int8_matvec", f"{name} {n_out} x {n_in}, rows {rows}", base_name,
                            bytes_moved(rows, n_in, n_out, x.element_size()),
                            partial(int8_matvec, x, layer.int8_weight(), layer.scales), partial(step, x), device))
    return out


def run(device="cuda", dtype=None, cfg: Qwen2Config | None = None, quick: bool = False) -> dict:
    """Every kernel beside its baseline -> a record (meta + rows). ``quick``: small shapes and one size
    each, for a CPU rehearsal under the interpreter."""
    device = resolve_device(device)
    dtype = dtype or half_dtype(device)
    reason = unavailable_reason(device, dtype)
    if reason:
        raise RuntimeError(f"the kernels cannot run here: {reason}")
    s = shape_of(cfg)
    t0 = time.perf_counter()
    rows = (norm_rows(s, dtype, device, (1,) if quick else (1, 8)) + rope_rows(s, dtype, device, 256 if quick else 4096)
            + attention_rows(s, dtype, device, (64,) if quick else (64, 1024, 4096))
            + int8_rows(s, dtype, device, (1,) if quick else (1, 8)))
    return {"meta": {"device": str(device), "device_name": device_name(device), "dtype": str(dtype).removeprefix("torch."),
                     "torch": torch.__version__, "triton": _triton_version(), "interpreter": interpreting(),
                     "shape": s, "copy_bandwidth_bytes_s": copy_bandwidth(device),
                     "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "seconds": round(time.perf_counter() - t0, 1)},
            "rows": [asdict(r) | {"speedup": r.speedup, "gbps": r.gbps()} for r in rows]}


def _triton_version() -> str | None:
    from ..kernels import triton_version

    return triton_version()


def report(record: dict) -> str:
    """The table a reader sees: one line per kernel and shape. Interpreter timings are not shown."""
    m = record["meta"]
    lines = [f"{m['device_name']} ({m['device']}), {m['dtype']}, torch {m['torch']}, triton {m['triton']}"]
    if m["interpreter"]:
        lines.append("Triton's CPU interpreter: results checked, not timed (numpy runs each program)")
        for r in record["rows"]:
            lines.append(f"  {r['kernel']:<17} {r['shape']:<30} max |ours - baseline| {r['max_abs_diff']:.2g}")
            lines.append(f"  {'':<17} baseline: {r['baseline']}")
        return "\n".join(lines)
    roof = m["copy_bandwidth_bytes_s"] / 1e9
    lines.append(f"copy roofline {roof:.0f} GB/s; GB/s = the kernel's ideal bytes / its time")
    for r in record["rows"]:
        lines.append(f"  {r['kernel']:<17} {r['shape']:<30} {r['ours_us']:8.1f} us vs {r['baseline_us']:8.1f} us "
                     f"({r['speedup']:.2f}x)  {r['gbps']:6.0f} GB/s = {r['gbps'] / roof:4.0%} of copy")
        lines.append(f"  {'':<17} baseline: {r['baseline']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description="Our Triton kernels beside the ops they replace (chapter 14).")
    p.add_argument("--device", default=None)
    p.add_argument("--model", default=None, help="a checkpoint folder whose config gives the shapes")
    p.add_argument("--quick", action="store_true", help="one small size per kernel (a CPU rehearsal)")
    p.add_argument("--out", default=None, help="write the record here (JSON)")
    args = p.parse_args()
    cfg = Qwen2Config.from_json(args.model) if args.model else None
    device = resolve_device(args.device)
    if device.type == "cpu" and interpreting() and interpreter_reason():  # a rehearsal under an older Triton
        print(f"kernels: skipped: {interpreter_reason()}")
        return
    record = run(device, cfg=cfg, quick=args.quick)
    print(report(record))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
