"""What a generation returns for one prompt: ``GenerationResult``.

Defined in chapter 04 (the first token loop) and returned by every client of the token loop:
``Engine.generate`` and the server's ``Scheduler.generate`` (chapter 12).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    """One prompt's output and how long it took (wall clock, device synchronised)."""

    token_ids: list[int]  # generated tokens only, stop token excluded
    text: str
    prompt_tokens: int
    ttft_s: float  # prompt in -> first new token on the host
    decode_tokens_per_s: float  # tokens after the first, per second of decode time
    finish_reason: str  # "stop" or "length"
    stage: str = ""
    dtype: str = ""
    device: str = ""
    extra: dict = field(default_factory=dict)

    def summary(self, timings: bool = True) -> str:
        """One line; ``timings=False`` leaves out TTFT and tok/s (one cold run measures warm-up)."""
        times = (f" | TTFT {self.ttft_s * 1e3:.1f} ms | decode {self.decode_tokens_per_s:.1f} tok/s"
                 if timings else "")
        return (f"{self.prompt_tokens} prompt + {len(self.token_ids)} new tokens{times}"
                f" | {self.stage}, {self.dtype}, {self.device}")
