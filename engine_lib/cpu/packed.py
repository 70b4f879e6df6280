"""bf16 weights kept in oneDNN's own blocked layout, for a CPU that multiplies bf16 in hardware.

Defined in chapter 06 (half precision), used by every bf16 layer on such a CPU (AVX-512 BF16 or
AMX: ``cpu_matmul.half_matmul_is_native``). ``F.linear`` hands oneDNN the plain (out, in) weight,
and oneDNN reorders it into the blocks its kernel reads on every call. Reordered once, when the
model is loaded (``torch.ops.mkldnn._reorder_linear_weight``), the weight streams from memory in
the order the kernel wants it. Measured on a 2-core AMD EPYC (Zen 4, AVX-512 BF16, no AMX), the
4-layer random checkpoint's matmuls of one step, weights cold, medians of 7: one row 18.7 ms
against 23.9 ms for our AVX2 matvec (``cpu_kernels``) and 33.6 ms for ``F.linear``; 16 rows 26.4
against 40.6 ms for ``F.linear``; 48 rows 52.8 against 68.5. The sums are oneDNN's, the same as
``F.linear``'s bit for bit (tested). On a CPU with AMX a lone row goes to our matvec instead, which
streams the weights faster there (``cpu_matmul.lone_row_takes_matvec``).

Used where ``cpu_matmul.packs_bf16_weights`` says so. The blocked copy is a second copy of each
weight (the plain one stays: the embedding, checkpoints and the other paths read it), so a bf16
model holds its layer weights twice on such a CPU: the bench's peak memory counts it (the half rung
of the 4-layer checkpoint on that Zen 4: 2.36 GiB, against 1.38 in the record before this copy).
``ENGINE_LIB_CPU_PACKED=0`` turns it off (for comparisons).

A compiled step cannot take the blocked tensor itself (it has no strides to trace), so there the layer
calls ``engine_lib::packed_linear(x, weight, bias)`` with its plain weight, an op opaque to the
compiler, which finds the blocked copy made from that weight. An eager layer finds the copy itself and
calls oneDNN directly (``linear``): the op's dispatch costs more than its sums on a decode row.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
import torch.utils.flop_counter
from torch import nn

from .kernels import linear_flops

ENV = "ENGINE_LIB_CPU_PACKED"
OP = "engine_lib::packed_linear"  # the op, as it is registered and as a profiler labels an eager call
PACKED_LINEAR = OP.replace("::", ".")  # the op's name, as ``bench.measure`` and ``matmul_kernels`` give it
ROWS_HINT = 1  # the row count oneDNN picks its blocks for; measured: 1 and 16 give the same speeds at 1 to 48 rows

# (data_ptr, shape) of a registered plain weight -> (the weight, weakly; its version when copied; its blocked
# copy). Entries go with their layer (``pack``); a weight that has died leaves a stale entry, never used
_PACKS: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}


@functools.cache
def available() -> bool:
    """Whether blocked bf16 weights can be made here: a oneDNN build with the reorder and bf16, and not
    switched off. Whether the layers use them is the CPU's call too (``cpu_matmul.packs_bf16_weights``)."""
    if os.environ.get(ENV, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape)


def _version(weight: torch.Tensor) -> int:
    """How many times the weight was written in place; an inference tensor (made under
    ``torch.inference_mode``) keeps no count, and is read as never written."""
    return -1 if weight.is_inference() else weight._version


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def _blocked(weight: torch.Tensor) -> torch.Tensor:
    """The blocked copy of a registered ``weight``, made again if the weight was written since (its version).
    A weight no layer registered is reordered on every call (correct, and as slow as ``F.linear``)."""
    key = _key(weight)
    entry = _PACKS.get(key)
    if entry is None or entry[0]() is None:  # not registered, or a dead weight's address reused
        return _reorder(weight)
    ref, version, packed = entry
    if version != _version(weight):
        packed = _reorder(weight)
        _PACKS[key] = (ref, _version(weight), packed)
    return packed


def pack(layer: nn.Linear) -> None:
    """Make ``layer``'s blocked copy now (at load, not in the first step), dropped when the layer goes."""
    key = _key(layer.weight)
    _PACKS[key] = (weakref.ref(layer.weight), _version(layer.weight), _reorder(layer.weight))
    weakref.finalize(layer, _PACKS.pop, key, None)


def packed_bytes() -> int:
    """Bytes held by blocked copies now."""
    return sum(p.numel() * p.element_size() for _, _, p in _PACKS.values())


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (rows, in) bf16 @ weight^T (+ bias) through ``weight``'s blocked copy -> (rows, out) bf16."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _blocked(weight), bias, "none", [], "")


@torch.library.custom_op(OP, mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _onednn(x, weight, bias)


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``packed_linear``, as the layers call it. Inside a compiled step, the custom op (opaque to inductor).
    Eagerly, oneDNN straight away: the custom op's Python dispatch cost the eager half rung's decode about 5%
    (2-core Zen 4, 4-layer 1.5B-shape checkpoint, 8 interleaved rounds: 1.06x, 0.96-1.18, 29 calls a token).
    Under a profiler it is labelled with the op's name, so the op counts (``bench.measure``) read the same;
    under a dispatch mode (``FlopCounterMode``, a fake-tensor trace) it is the op, whose FLOPs and shapes they know."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return torch.ops.engine_lib.packed_linear(x, weight, bias)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(OP):
            return _onednn(x, weight, bias)
    return _onednn(x, weight, bias)


torch.utils.flop_counter.register_flop_formula(torch.ops.engine_lib.packed_linear)(linear_flops)
