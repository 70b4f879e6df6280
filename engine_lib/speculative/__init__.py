"""Chapter 11: speculative decoding's drafters (``drafters``) and the rule that verifies their drafts (``verify``)."""

from .drafters import DraftModel, PromptLookup, Replay
from .verify import verify_tokens

__all__ = ["DraftModel", "PromptLookup", "Replay", "verify_tokens"]
