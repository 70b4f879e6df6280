"""Measurements that know their own noise: the one timing helper of the book and the bench.

Defined in chapter 00 ("How we measure") and used wherever a chapter compares two timings.

- ``measure(fn)`` warms up, then repeats ``fn`` until a minimum total time has passed (like
  ``timeit.Timer.autorange``), running it several times per sample when one call is too short
  for the clock, and keeps every sample.
- ``Samples`` holds them and reports a median with a spread (the interquartile range; the
  min-max range below four samples).
- ``relation(a, b)`` turns two ``Samples`` into words: "12% faster than", "2.4x slower than",
  or "within noise of" when the spreads overlap (for paired rounds, when the per-round ratios
  straddle 1). ``verdict`` gives the same decision as +1 / 0 / -1 for takeaway logic.
- ``plateau(samples)`` flags readings that are identical across sizes: a timer (or scheduler)
  tick, not a measurement.
- ``clock_line()`` is the host's clock resolution, printed once per chapter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..stages import sync  # the engine's own device wait, as every timer uses

MIN_TOTAL_S = 0.2  # keep repeating until this much time has been measured
MIN_SAMPLE_TICKS = 1000  # one sample spans at least this many clock steps (a tick is then <= 0.1%)
MIN_SAMPLE_S = 2e-3  # ... and this many seconds: a busy host's scheduler quantum is a few ms


@dataclass(frozen=True)
class Samples:
    """Repeated readings of one quantity. ``higher_is_better``: a rate (tok/s), not a duration."""

    values: tuple[float, ...]
    higher_is_better: bool = False

    def __post_init__(self):
        if not self.values:
            raise ValueError("Samples needs at least one reading")
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))

    @classmethod
    def rates(cls, values: Sequence[float]) -> Samples:
        return cls(tuple(values), higher_is_better=True)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        """Lower end of the spread: the first quartile (the minimum below four samples)."""
        if len(self.values) < 4:
            return min(self.values)
        return statistics.quantiles(self.values, n=4, method="inclusive")[0]

    @property
    def high(self) -> float:
        if len(self.values) < 4:
            return max(self.values)
        return statistics.quantiles(self.values, n=4, method="inclusive")[2]

    def __float__(self) -> float:
        return self.median

    def scaled(self, factor: float) -> Samples:
        """The same readings times ``factor`` (seconds to ms, or per call to per token)."""
        return Samples(tuple(v * factor for v in self.values), self.higher_is_better)

    def inverse(self) -> Samples:
        """Durations as rates (1/s) or rates as durations."""
        return Samples(tuple(1 / v for v in self.values), not self.higher_is_better)

    def text(self, spec: str = ".1f", unit: str = "") -> str:
        """'12.3 ms (11.9-12.8)': the median and its spread."""
        return f"{self.median:{spec}}{unit} ({self.low:{spec}}-{self.high:{spec}})"


def _as_samples(x, higher_is_better: bool) -> Samples:
    if isinstance(x, Samples):
        return x
    if isinstance(x, (int, float)):
        return Samples((float(x),), higher_is_better)
    return Samples(tuple(x), higher_is_better)


# ------------------------------------------------------------------------------------- the clock
def clock_step(trials: int = 2000) -> float:
    """The smallest nonzero step ``time.perf_counter`` was seen to take on this host, in seconds."""
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        t1 = time.perf_counter()
        while t1 == t0:
            t1 = time.perf_counter()
        best = min(best, t1 - t0)
    return best


def clock_line() -> str:
    """The host clock's declared resolution and its measured smallest step (print once)."""
    info = time.get_clock_info("perf_counter")
    return (f"host clock: time.perf_counter ({info.implementation}), declared resolution "
            f"{info.resolution * 1e9:.0f} ns, smallest step seen {clock_step() * 1e9:.0f} ns")


# ----------------------------------------------------------------------------------- measuring
def measure(fn: Callable, device=None, warmup: int = 1, min_total_s: float = MIN_TOTAL_S,
            min_repeats: int = 5, max_repeats: int = 1000, number: int | None = None) -> Samples:
    """Seconds per call of ``fn()``: ``warmup`` calls first, then samples until ``min_total_s``
    has been measured (and at least ``min_repeats`` samples). Each sample times ``number``
    calls in a row and divides: if not given, ``number`` doubles until one sample lasts
    ``MIN_SAMPLE_TICKS`` clock steps and ``MIN_SAMPLE_S``, so no reading is a clock tick.
    The device is synchronised around every sample."""
    for _ in range(warmup):
        fn()
    device = device or "cpu"

    def sample(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        return time.perf_counter() - t0

    values, total = [], 0.0
    if number is None:
        floor = max(MIN_SAMPLE_TICKS * clock_step(200), MIN_SAMPLE_S)
        number = 1
        while True:
            t = sample(number)
            total += t
            if t >= floor or number >= 1 << 20:
                values.append(t / number)
                break
            number *= 2
    while (total < min_total_s or len(values) < min_repeats) and len(values) < max_repeats:
        t = sample(number)
        total += t
        values.append(t / number)
    return Samples(tuple(values))


# ------------------------------------------------------------------------------------ comparing
def verdict(a, b, paired: bool = False) -> int:
    """+1 if ``a`` is better than ``b`` beyond the noise, -1 if worse, 0 if within noise.

    Unpaired: the spreads (``low``-``high``) overlap -> 0. Paired (the same rounds, A B A B ...):
    the per-round ratios a/b -> 0 if their spread contains 1. Floats count as one reading each
    (no spread: any difference decides), so give ``Samples`` wherever there are repeats."""
    hib = a.higher_is_better if isinstance(a, Samples) else True
    a, b = _as_samples(a, hib), _as_samples(b, hib)
    if paired and len(a.values) == len(b.values) and len(a.values) > 1:
        r = Samples(tuple(x / y for x, y in zip(a.values, b.values)))
        if r.low <= 1 <= r.high:
            return 0
        better = r.median > 1
    else:
        if a.low <= b.high and b.low <= a.high:
            return 0
        if a.median == b.median:
            return 0
        better = a.median > b.median
    return 1 if better == a.higher_is_better else -1


def ratio_words(r: float) -> str:
    """How many times faster (r > 1) a is, as '2.4x' or '12%'."""
    if r >= 1:
        return f"{r:.1f}x" if r >= 1.5 else f"{100 * (r - 1):.0f}%"
    return f"{1 / r:.1f}x" if r <= 1 / 1.5 else f"{100 * (1 - r):.0f}%"


def relation(a, b, more: str = "faster", less: str = "slower", same: str = "within noise of",
             paired: bool = False) -> str:
    """``a`` against ``b`` in words: '2.4x faster than', '12% slower than' or 'within noise of'.

    ``a`` and ``b`` are ``Samples`` (durations or rates: ``higher_is_better`` says which).
    The direction is only stated when ``verdict`` decides it."""
    v = verdict(a, b, paired)
    if v == 0:
        return same
    hib = a.higher_is_better if isinstance(a, Samples) else True
    ma, mb = float(a if not isinstance(a, Samples) else a.median), float(b if not isinstance(b, Samples) else b.median)
    r = ma / mb if hib else mb / ma  # > 1: a is better
    if r >= 1.05 or r <= 1 / 1.05:
        words = ratio_words(r)
    else:
        words = f"{100 * abs(r - 1):.1f}%"
    return f"{words} {more if v > 0 else less} than"


def plateau(samples: Sequence, rel: float = 0.005) -> bool:
    """True when three or more readings taken at different sizes are all equal within ``rel``:
    the clock or the scheduler's tick measured them, not the work."""
    medians = [float(s.median if isinstance(s, Samples) else s) for s in samples]
    if len(medians) < 3 or min(medians) <= 0:
        return False
    return max(medians) / min(medians) - 1 <= rel


def flat_run(samples: Sequence[Samples]) -> int:
    """How many of the first readings (smallest sizes first) all overlap in spread: 3 or more
    means the work grew and the clock did not see it (a busy host's scheduler quantum, a timer
    tick). 0 when fewer than three overlap."""
    n = 1
    while n < len(samples):
        window = samples[:n + 1]
        if max(s.low for s in window) > min(s.high for s in window):
            break
        n += 1
    return n if n >= 3 else 0


def plateau_note(samples: Sequence, what: str = "these timings", sizes: Sequence | None = None) -> str:
    """A sentence for the page when the readings are flat across sizes (``plateau``, or for
    ``Samples`` a ``flat_run`` of three or more), else ''."""
    if plateau(samples):
        return (f"Warning: {what} are equal at every size, so they measure this host's clock or "
                "scheduler tick, not the work; read no trend into them.")
    if samples and all(isinstance(s, Samples) for s in samples) and (n := flat_run(list(samples))):
        span = f" ({sizes[0]} to {sizes[n - 1]})" if sizes else ""
        return (f"Note: {what} at the {n} smallest sizes{span} are equal within their spread: at those sizes "
                "this host's clock or scheduler, not the work, set the reading; read no trend into them.")
    return ""
