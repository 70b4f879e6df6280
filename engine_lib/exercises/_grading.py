"""What every check shares: run the reader's answer on several cases, compare it with the
engine's own result, and say kindly and precisely what differs.

Defined for the exercises at the end of every chapter (see ``engine_lib/exercises``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import torch


@dataclass
class Result:
    """A check's verdict: true when every case agreed. ``message`` is what was printed."""

    exercise: str
    passed: bool
    message: str
    cases: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"Result({self.exercise}, passed={self.passed})"

    def _ipython_display_(self) -> None:
        """The verdict is already printed: show nothing more in a notebook."""


class Mismatch(Exception):
    """Raised by a case when the reader's answer differs; its text is the verdict."""


def tensor_diff(got, want: torch.Tensor, what: str = "your result", atol: float = 1e-5, rtol: float = 1e-5,
                check_dtype: bool = True) -> str | None:
    """None when ``got`` matches ``want``, else one sentence: type, shape, dtype or the first wrong element."""
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, expected a torch.Tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if check_dtype and got.dtype != want.dtype:
        return f"{what} has dtype {got.dtype}, expected {want.dtype}"
    if want.dtype == torch.bool or not (want.is_floating_point() or want.is_complex()):
        bad = got.detach().cpu() != want.detach().cpu()
        g, w = got.detach().cpu(), want.detach().cpu()
    else:
        g, w = got.detach().double().cpu(), want.detach().double().cpu()
        bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=False)
        bad &= ~((g == w) | (g.isnan() & w.isnan()))  # equal infinities and NaN where expected agree
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    msg = (f"{what}: first difference at index {list(idx)}, {g[idx].item():.6g} where the engine has {w[idx].item():.6g} "
           f"({int(bad.sum())} of {bad.numel()} elements differ")
    if g.is_floating_point():
        finite = g.isfinite() & w.isfinite()
        if (bad & finite).any():
            msg += f"; largest difference {(g - w)[bad & finite].abs().max().item():.3g}"
        if (bad & ~g.isfinite()).any():
            msg += f"; {int((bad & ~g.isfinite()).sum())} of yours are inf or NaN"
    return msg + ")"


def expect_tensor(got, want: torch.Tensor, what: str = "your result", **kw) -> None:
    diff = tensor_diff(got, want, what, **kw)
    if diff:
        raise Mismatch(diff)


def expect_equal(got, want, what: str = "your result") -> None:
    if got != want:
        raise Mismatch(f"{what} is {got!r}, expected {want!r}")


def expect_tokens(got, want: list[int], prompt_len: int) -> list[int]:
    """The reader's generated ids (list or tensor) as a list, or a Mismatch naming the first wrong one."""
    got = got.flatten().tolist() if isinstance(got, torch.Tensor) else list(got)
    if got != want:
        if len(got) != len(want):
            raise Mismatch(f"you returned {len(got)} tokens, expected {len(want)} (only the new ones, "
                           f"not the {prompt_len}-token prompt)")
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        raise Mismatch(f"token {k} is {got[k]}, the engine's greedy choice is {want[k]} (yours: {got}, "
                       f"engine: {want})")
    return got


def expect_close(got, want: float, what: str = "your number", rel: float = 0.01) -> None:
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        raise Mismatch(f"{what} is a {type(got).__name__}, expected a number")
    if not math.isclose(got, want, rel_tol=rel, abs_tol=1e-12):
        raise Mismatch(f"{what} is {got:.6g}, expected {want:.6g} (within {rel:.0%}); "
                       f"yours is {got / want if want else float('inf'):.3g} times the engine's")


def grade(exercise: str, cases: list[tuple[str, Callable[[], None]]], hint: str = "") -> Result:
    """Run each case; stop at the first that differs. Prints the verdict and returns it."""
    for label, case in cases:
        try:
            case()
        except Mismatch as exc:
            msg = f"✗ {exercise}, not yet. On {label}: {exc}."
            if hint:
                msg += f"\n  Hint: {hint}"
            print(msg)
            return Result(exercise, False, msg, [c for c, _ in cases])
        except Exception as exc:  # the reader's code raised: name it, without a trace
            msg = f"✗ {exercise}, not yet. On {label} your code raised {type(exc).__name__}: {exc}"
            if hint:
                msg += f"\n  Hint: {hint}"
            print(msg)
            return Result(exercise, False, msg, [c for c, _ in cases])
    labels = ", ".join(c for c, _ in cases)
    msg = f"✓ {exercise}: all {len(cases)} cases agree with the engine ({labels})."
    print(msg)
    return Result(exercise, True, msg, [c for c, _ in cases])


def rand(*shape, seed: int = 0, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reproducible test data that leaves the global random state alone."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@lru_cache(maxsize=4)
def tiny_model(fused: bool = False):
    """The offline tiny random checkpoint (real vocabulary, 4 small layers), fp32 on the CPU."""
    from ..model.checkpoints import ensure_checkpoint
    from ..model.loader import load_model
    from ..model.qwen2 import ModelOptions
    path = ensure_checkpoint("tiny")
    return load_model(path, torch.float32, torch.device("cpu"), ModelOptions(fused=fused)).eval()


def tiny_path():
    from ..model.checkpoints import ensure_checkpoint
    return ensure_checkpoint("tiny")


@lru_cache(maxsize=1)
def tiny_engine():
    """An engine over the tiny checkpoint: fp32 on the CPU, the kv_cache rung (loaded once, shared by the checks)."""
    from ..engine import Engine

    return Engine.from_pretrained(tiny_path(), device="cpu", dtype=torch.float32, stage="kv_cache")
