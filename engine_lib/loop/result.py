"""What a generation returns for one prompt: ``GenerationResult``, and the one function that builds it.

Defined in chapter 04 (the first token loop) and returned by every client of the token loop:
``Engine.generate`` and the serving loop's ``generate`` (chapter 12). ``result_of`` reads a finished
sequence: its tokens, its text (decoded once, by the output processor), its times and how it ended.
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


def result_of(seq, text: str, start: float, stage: str, dtype: str, device: str, extra: dict | None = None,
              speculative: bool = False) -> GenerationResult:
    """A finished sequence as a ``GenerationResult``: TTFT from ``start`` (the call's start, or the request's
    arrival), the decode rate over the tokens after the first, the reason it finished. With ``speculative``,
    its drafting counts go in ``extra`` under the names chapter 11 reports."""
    out, first, last = list(seq.output_ids), seq.first_token_at, seq.last_token_at
    rate = (len(out) - 1) / (last - first) if first is not None and len(out) > 1 and last > first else float("nan")
    ttft = first - start if first is not None else float("nan")
    extra = dict(extra or {})
    if speculative:
        extra.update(acceptance_rate=seq.accepted / max(seq.drafted, 1), drafted=seq.drafted, accepted=seq.accepted,
                     target_forwards=seq.forwards, tokens_per_target_forward=seq.made / max(seq.forwards, 1))
    return GenerationResult(out, text, len(seq.prompt_ids), ttft, rate, seq.finish_reason, stage, dtype, device,
                            extra)
