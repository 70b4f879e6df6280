"""Check the BUILT book in headless Chromium: pages render, no JavaScript errors, plots and tokens show.

Skipped unless the book has been built (``bash scripts/build_book.sh --execute``) and
``chromium`` is on PATH (Debian: ``apt-get install chromium``). The site is served from
127.0.0.1 by ``python -m http.server``, started and stopped here. Screenshots go to a
temporary folder (or to ``$BOOK_SCREENSHOT_DIR`` if set) for a human to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAGES = {"01": "chapters/01_tokens.html", "08": "chapters/08_results.html"}
PLOT = re.compile(r'<img[^>]+src="(data:image/png[^"]*|[^"]*_images/[^"]+\.png)"')

pytestmark = [
    pytest.mark.skipif(not (SITE / PAGES["01"]).is_file(),
                       reason="book not built: run `bash scripts/build_book.sh --execute` first"),
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (apt-get install chromium)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def site_url():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(SITE)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/index.html", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("the local http.server did not start")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{time.monotonic_ns()}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           "--virtual-time-budget=10000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def js_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "Uncaught" in line]


def screenshot_dir(tmp_path: Path) -> Path:
    out = Path(os.environ.get("BOOK_SCREENSHOT_DIR", tmp_path / "screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.mark.parametrize("chapter", list(PAGES))
def test_page_renders_without_js_errors(chapter, site_url, tmp_path):
    page = PAGES[chapter]
    if not (SITE / page).is_file():
        pytest.skip(f"{page} is not in the built site (chapter not written yet?)")
    run = chromium(tmp_path, "--dump-dom", f"{site_url}/{page}")
    dom = run.stdout
    assert run.returncode == 0, run.stderr[-2000:]
    assert "<html" in dom and "</html>" in dom, "no DOM came back"
    assert not js_errors(run.stderr), "JavaScript errors:\n" + "\n".join(js_errors(run.stderr))
    assert PLOT.search(dom), f"{page}: no plot image (png) in the page"
    if chapter == "01":
        assert 'class="tok-chip' in dom, "chapter 01: no coloured token rendering"
        assert "tok-special" in dom, "chapter 01: special tokens not styled"
        assert "application/vnd.jupyter.widget-state+json" in dom, "chapter 01: widget state not embedded"
        assert "application/vnd.jupyter.widget-view+json" in dom, "chapter 01: widget view missing"


@pytest.mark.parametrize("height", [2000, 12000])  # the top of the page, and (nearly) all of it
def test_screenshot(height, site_url, tmp_path):
    out = screenshot_dir(tmp_path) / f"01_tokens_1280x{height}.png"
    run = chromium(tmp_path, f"--screenshot={out}", f"--window-size=1280,{height}", f"{site_url}/{PAGES['01']}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert not js_errors(run.stderr), "JavaScript errors:\n" + "\n".join(js_errors(run.stderr))
    assert out.is_file() and out.stat().st_size > 10_000, f"no screenshot at {out}"
    print(f"screenshot: {out}")
