"""bf16 weights in oneDNN's blocked layout (``cpu_packed``): the same sums as ``F.linear``, at every row
count, eager and compiled, and the layers use them only where the CPU multiplies bf16 in hardware."""

import gc

import pytest
import torch
import torch.nn.functional as F

from engine_lib.cpu import kernels as cpu_kernels
from engine_lib.cpu import packed as cpu_packed
from engine_lib.cpu.matmul import Linear, lone_row_takes_matvec, packs_bf16_weights, use_cpu_kernels

needs_packed = pytest.mark.skipif(not packs_bf16_weights(), reason="this CPU has no bf16 instructions")


def _layer(out_f=48, in_f=128, bias=True) -> Linear:
    torch.manual_seed(0)
    lin = Linear(in_f, out_f, bias=bias).bfloat16().requires_grad_(False)
    use_cpu_kernels(lin)
    return lin


@needs_packed
@pytest.mark.parametrize("rows", [1, 2, 16, 48])
@pytest.mark.parametrize("bias", [True, False])
def test_blocked_weights_give_f_linears_sums_bit_for_bit(rows, bias):
    lin = _layer(bias=bias)
    assert lin.packed
    x = torch.randn(rows, 128).bfloat16()
    ref = F.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(torch.ops.engine_lib.packed_linear(x, lin.weight, lin.bias), ref, rtol=0, atol=0)
    lin.lone_row_matvec = lin.one_call_row = False  # the layer on blocked weights at every row count
    torch.testing.assert_close(lin(x.view(1, rows, 128)), ref.view(1, rows, 48), rtol=0, atol=0)


@needs_packed
@pytest.mark.parametrize("compiled", [False, True])
def test_a_lone_row_takes_our_matvec_where_the_cpu_has_amx_and_two_rows_the_blocked_weights(compiled):
    """On a CPU with AMX a decode row streams the weights faster through our matvec than through oneDNN's
    one-row kernel (``lone_row_takes_matvec``); two rows or more keep the blocked weights."""
    if not cpu_kernels.available():
        pytest.skip(f"our CPU kernels are off ({cpu_kernels.unavailable_reason()})")
    lin = _layer(out_f=64, in_f=256)
    assert lin.lone_row_matvec == lone_row_takes_matvec()
    lin.lone_row_matvec = lin.one_call_row = True  # as on a CPU with AMX, whichever CPU runs the test
    run = torch.compile(lin, dynamic=True, fullgraph=True) if compiled else lin
    for rows in (1, 2, 5):
        x = torch.randn(1, rows, 256).bfloat16()
        with torch.inference_mode():
            y = run(x)  # compiled first, then profiled (a compiled graph's ops are not top-level events)
            with torch.profiler.profile() as prof:
                run(x)
        names = {e.name for e in prof.events()}
        ours = {"engine_lib_cpu::bf16_linear", "engine_lib_cpu::bf16_gemv"} & names
        if rows == 1:
            assert ours and cpu_packed.OP not in names, names
            want = torch.ops.engine_lib_cpu.bf16_linear(x.view(1, 256), lin.weight, lin.bias)
        else:
            assert cpu_packed.OP in names and not ours, names
            want = F.linear(x.view(rows, 256), lin.weight, lin.bias)
        assert torch.equal(y.view(rows, 64).view(torch.int16), want.view(torch.int16))


@needs_packed
def test_a_weight_written_in_place_is_copied_again():
    lin = _layer()
    x = torch.randn(3, 128).bfloat16()
    before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    assert not torch.equal(lin(x), before)


@needs_packed
def test_the_blocked_copy_goes_with_its_layer():
    before = cpu_packed.packed_bytes()
    lin = _layer(out_f=64, in_f=256)
    assert cpu_packed.packed_bytes() - before >= 64 * 256 * 2
    del lin
    gc.collect()
    assert cpu_packed.packed_bytes() == before


@needs_packed
def test_a_compiled_step_calls_it_as_one_op_at_any_batch():
    lin = _layer()
    step = torch.compile(lambda x: lin(x) * 2, dynamic=True, fullgraph=True)  # fullgraph: no graph break
    for rows in (2, 5, 16):
        x = torch.randn(rows, 128).bfloat16()
        torch.testing.assert_close(step(x), F.linear(x, lin.weight, lin.bias) * 2, rtol=0, atol=0)


@needs_packed
def test_rows_summed_alone_take_our_kernel_not_onednn():
    if not cpu_kernels.available():
        pytest.skip(f"our CPU kernels are off ({cpu_kernels.unavailable_reason()})")
    lin = _layer()
    x = torch.randn(4, 128).bfloat16()
    with cpu_kernels.rows_alone(), torch.profiler.profile() as prof:
        y = lin(x)
    names = {e.name for e in prof.events()}
    # our matvec: the one-call bf16 layer of an eager call (or the matvec on fp32 rows)
    assert names & {"engine_lib_cpu::bf16_linear", "engine_lib_cpu::bf16_gemv"} and "engine_lib::packed_linear" not in names
    for i in range(4):  # each row as it comes alone
        torch.testing.assert_close(y[i:i + 1], lin(x[i:i + 1].clone()), rtol=2 ** -7, atol=1e-2)


def test_switched_off_the_layers_keep_the_plain_weight(monkeypatch):
    monkeypatch.setenv(cpu_packed.ENV, "0")
    cpu_packed.available.cache_clear()
    try:
        assert not cpu_packed.available() and not packs_bf16_weights()
        lin = _layer()
        assert not lin.packed
        x = torch.randn(2, 128).bfloat16()
        torch.testing.assert_close(lin(x).float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()),
                                   rtol=2 ** -7, atol=1e-2)
    finally:
        cpu_packed.available.cache_clear()


@needs_packed
def test_a_weight_no_layer_registered_is_reordered_on_each_call():
    for _ in range(3):  # fresh weights of one shape, often at a freed one's address: never a stale copy
        w = torch.randn(48, 128).bfloat16()
        x = torch.randn(2, 128).bfloat16()
        torch.testing.assert_close(torch.ops.engine_lib.packed_linear(x, w, None), F.linear(x, w), rtol=0, atol=0)


@needs_packed
def test_a_layer_made_under_inference_mode_runs_too():
    """Inference tensors keep no version count (a reader who loads the model inside torch.inference_mode)."""
    with torch.inference_mode():
        lin = _layer()
        assert lin.weight.is_inference() and lin.packed
        x = torch.randn(3, 128).bfloat16()
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)


@needs_packed
def test_flops_are_counted_as_for_any_linear():
    """Chapter 08's FLOPs per byte: 2 per weight and row, as for our matvec kernels (one formula for both)."""
    from torch.utils.flop_counter import FlopCounterMode

    lin = _layer(bias=False)
    with FlopCounterMode(display=False) as flops:
        lin(torch.randn(5, 128).bfloat16())
    assert flops.get_total_flops() == 2 * 5 * 128 * 48


@needs_packed
def test_eager_calls_skip_the_custom_op_but_count_as_it():
    """Eagerly the layer calls oneDNN itself (the custom op's dispatch is for compiled steps), labelled with
    the op's name under a profiler: op counts and kernel names read the same either way."""
    from engine_lib.bench.measure import top_level_op_names

    lin = _layer()
    x = torch.randn(3, 128).bfloat16()
    names = top_level_op_names(lambda: lin(x))
    assert names[cpu_packed.PACKED_LINEAR] == 1 and "mkldnn._linear_pointwise" not in names
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)


@needs_packed
def test_a_weight_that_needs_its_gradient_takes_f_linear():
    lin = _layer().requires_grad_(True)
    x = torch.randn(3, 128).bfloat16()
    y = lin(x)
    y.sum().backward()
    assert lin.weight.grad is not None
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
