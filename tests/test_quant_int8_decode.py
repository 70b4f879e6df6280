"""int8 decoding without weight-sized temporaries (issue 14), the CUDA form checked on CPU.

On CUDA no packed int8 kernel is used: inside the compiled decode step every int8 layer is a
multiply-and-sum that inductor fuses with the int8 -> float conversion. Here the CPU engine's
layers are switched to that same form (``kernel = DENSE``, as on a GPU) and the compiled step
at batch 3, in fp16 and bf16, is read from inductor's generated code: no buffer of any weight's
size may be allocated. The old form converted every weight (fp16: to an fp32 copy) each step.
"""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from engine_lib import Engine
from engine_lib.quant.linear import DENSE, quantized_linears
from engine_lib.step import compiled as compiled_step


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_compiled_int8_decode_at_batch_3_allocates_no_weight_sized_tensor(tiny_dir, prompts, dtype, monkeypatch):
    monkeypatch.setattr(compiled_step, "_COMPILED", {})
    monkeypatch.setattr(compiled_step, "_VARIANTS", {})
    torch._dynamo.reset()
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage="int8")
    layers = quantized_linears(engine.model)
    for layer in layers.values():
        layer.kernel = DENSE  # the CUDA form
    weight_sizes = {layer.out_features * layer.in_features for layer in layers.values()}
    batch = [prompts[0], prompts[1][:7], prompts[2]]
    want = [r.token_ids for r in engine.generate_batch(batch, max_new_tokens=4, do_sample=False)]  # compiles
    assert engine.step_form == "compiled" and engine.fallbacks == []
    torch._dynamo.reset()  # compile again, this time keeping the generated code
    compiled_step._VARIANTS.clear()
    results, codes = run_and_get_code(
        lambda: [r.token_ids for r in engine.generate_batch(batch, max_new_tokens=4, do_sample=False)])
    assert results == want and engine.step_form == "compiled"
    code = "\n".join(codes)
    assert "empty_strided" in code  # the check reads real allocations
    for shape in re.findall(r"empty_strided\w*\(\(([^)]*)\)", code):
        dims = [int(d) for d in re.findall(r"\d+", shape)] if re.fullmatch(r"[\d,\s]*", shape) else []
        numel = 1
        for d in dims:
            numel *= d
        assert not dims or numel not in weight_sizes, f"a weight-sized buffer ({shape}) in the decode step"
