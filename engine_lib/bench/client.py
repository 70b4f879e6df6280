"""Small client helpers for an OpenAI-compatible server: its model name, its ``/metrics``, and
running a coroutine from a script or a notebook alike.

Defined in chapter 12 (serving many users); used by ``loadtest`` and ``prefix_ttft``.
"""

from __future__ import annotations

import asyncio


def run_async(coro):
    """``asyncio.run``, also from inside a running event loop (a notebook): then in a fresh thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def scrape(base_url: str, api_key: str = "none") -> dict:
    import httpx

    from ..loop.metrics import parse

    try:
        r = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
        return parse(r.text) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


def served_model(base_url: str, api_key: str = "none") -> str:
    import httpx

    r = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def metric(values: dict[str, float], name: str) -> float | None:
    """One metric from ``loop.metrics.parse``'s output, summed over its labels; None when absent."""
    found = [v for k, v in values.items() if k == name or k.startswith(name + "{")]
    return sum(found) if found else None
