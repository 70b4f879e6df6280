"""Speculative decoding: drafters and the rule that verifies their drafts (chapter 11)."""

from .drafters import *  # noqa: F401,F403
