"""Choosing tokens and streaming text: greedy, temperature, top-k, top-p, penalties (chapter 09)."""

from .pick import *  # noqa: F401,F403
from .pick import (  # noqa: F401
    OPTIONS,
    TOP_K_CANDIDATES,
    PickMode,
    SamplingParams,
    SamplingState,
    adjust_logits,
    apply_repetition_penalty,
    check_number,
    check_option_names,
    filter_top_k_top_p,
    is_int,
    non_finite,
    pick_modes,
    top_candidates,
)
