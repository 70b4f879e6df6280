"""``python -m engine_lib.bench.footprint MODEL_DIR STAGE DEVICE``: one rung's memory, measured in a fresh process.

Defined in chapter 10 (quantization); ``measure.load_footprint`` runs it, so nothing the caller
holds is counted. It loads the rung, runs a 32-token prefill and prints one JSON line: ``peak``
memory, ``base`` (CPU: the process's RSS before loading), ``held_bytes`` (the model's tensors),
``weight_bytes`` (read per decode token) and the ``kernels`` of its weight matmuls.
"""

from __future__ import annotations

import json
import sys

from ..engine import Engine
from .measure import matmul_kernels, peak_memory_bytes, reset_peak_memory, tensor_bytes, weight_bytes


def main(argv: list[str]) -> int:
    path, stage, device = argv
    base = peak_memory_bytes(device) if device == "cpu" else 0  # the interpreter, torch and engine_lib
    reset_peak_memory(device)
    engine = Engine.from_pretrained(path, device=device, stage=stage)
    engine.generate([1000 + i for i in range(32)], max_new_tokens=1, do_sample=False, stop_token_ids=())
    peak = peak_memory_bytes(device)
    held = sum(tensor_bytes(p) for p in engine.model.parameters())  # a tied matrix is one parameter
    print(json.dumps({"peak": peak, "base": base, "held_bytes": held, "weight_bytes": weight_bytes(engine.model),
                      "kernels": matmul_kernels(engine.model)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
