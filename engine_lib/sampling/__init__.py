"""Chapter 09: every per-request option (``SamplingParams``), choosing tokens on the device, streamed text."""

from .params import OPTIONS, SamplingParams, check_option_names
from .pick import (
    TOP_K_CANDIDATES,
    PickMode,
    SamplingState,
    adjust_logits,
    apply_repetition_penalty,
    filter_top_k_top_p,
    non_finite,
    pick_modes,
    top_candidates,
)

__all__ = ["OPTIONS", "SamplingParams", "check_option_names", "TOP_K_CANDIDATES", "PickMode", "SamplingState",
           "adjust_logits", "apply_repetition_penalty", "filter_top_k_top_p", "non_finite", "pick_modes",
           "top_candidates"]
