"""Chapters 00 to 14: exercises that check themselves, one module per chapter (``ch00`` ... ``ch14``).

Each module holds the chapter's exercise texts (``EXERCISES``, the source of the notebook's
"Exercises" cell, written by ``scripts/add_exercises.py``) and one check per exercise. A
reader calls a check with their answer, ``check.ex05_2(my_function)``: it runs the answer
next to the engine's own code on several cases, prints a short verdict that names what
differs, and returns a ``Result`` that is true when every case agreed. Worked solutions:
``solutions/NN_*.ipynb``.

The checks import the engine and the book's helpers, and chapter 14's the kernels (``engine_lib.kernels``,
which imports Triton only when a check runs).
"""

from . import ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, ch12, ch13, ch14
from ._grading import Result

CHAPTERS = {m.SOLUTIONS[:2]: m for m in (ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, ch12,
                                         ch13, ch14)}

__all__ = ["CHAPTERS", "Result", "check"]


def checks(chapter: str) -> list:
    """The check functions of one chapter ("05"), in order."""
    mod = CHAPTERS[chapter]
    return [getattr(mod, f"ex{chapter}_{i}") for i in range(1, len(mod.EXERCISES) + 1)]


from . import check  # noqa: E402  (the namespace readers use: check.ex05_2)
