"""A one-way hook: the engine announces every model and KV cache it makes; whoever listens may count them.

Defined in chapter 00, for the book's T4 memory budget (``engine_lib/book/memory_budget.py``),
which listens. The engine knows only this module: it calls ``note`` and never learns who, if
anyone, is listening, so no engine file imports the book.
"""

from __future__ import annotations

from collections.abc import Callable

_LISTENERS: list[Callable[[object, str], None]] = []


def listen(fn: Callable[[object, str], None]) -> None:
    """Call ``fn(obj, what)`` for every object the engine notes from now on (once per function)."""
    if fn not in _LISTENERS:
        _LISTENERS.append(fn)


def note(obj, what: str) -> None:
    """Called by the engine for every model (``what``: ``"engine weights"``) and KV cache (``"kv_cache"``)
    it makes; a no-op when nobody listens."""
    for fn in _LISTENERS:
        fn(obj, what)
