"""Chapter 11: speculative decoding's drafters (``drafters``, ``suffix``) and the rule that verifies their drafts
(``verify``)."""

from .drafters import DraftModel, PromptLookup, Replay
from .suffix import SuffixDrafter
from .verify import verify_tokens

DRAFTERS = {"prompt_lookup": PromptLookup, "suffix": SuffixDrafter}  # by name: the ones that need no model


def drafter_named(name: str):
    """A fresh drafter of a ``DRAFTERS`` name."""
    return DRAFTERS[name]()


__all__ = ["DRAFTERS", "DraftModel", "PromptLookup", "Replay", "SuffixDrafter", "drafter_named", "verify_tokens"]
