"""What the bench times: a ``System`` (an engine rung, a ``transformers`` baseline or a peer such as
llama.cpp) on a ``Workload`` (prompts and a token count).

Defined in chapter 08 (results); ``bench.run`` measures them, ``bench.llamacpp`` adds the peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class System:
    name: str
    kind: str  # "engine", "hf" or "peer" (llama.cpp: bench/llamacpp.py)
    dtype: torch.dtype
    stage: str = ""  # engine rung
    hf_mode: str = ""  # "naive" (use_cache=False), "generate" (default cache), "static_compile",
    # "torchao_int8" (generate, with torchao's int8 weight-only quantization: chapter 10's baseline)
    peer: str = ""  # the GGUF type llama.cpp runs ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list  # token-id lists
    max_new_tokens: int
    batch: bool = False


class BaselineUnavailable(Exception):
    """A baseline that cannot run here (a package that is not installed): skipped, with a note."""
