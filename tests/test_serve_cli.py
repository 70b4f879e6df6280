"""``python -m engine_lib serve`` as a subprocess on 127.0.0.1: it starts, streams, refuses a wrong
key, and stops when told to."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_help():
    out = subprocess.run([sys.executable, "-m", "engine_lib", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--api-key", "--kv-cache-gib", "--stage", "--max-batch", "--max-queue"):
        assert flag in out.stdout


def test_serve_subprocess_streams_and_stops(tiny_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "engine_lib", "serve", "--model", str(tiny_dir), "--port", str(port),
           "--api-key", "k", "--kv-cache-gib", "0.01", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                "temperature": 0, "stream": True}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer no"}).status_code == 401
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"},
                          timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert "127.0.0.1" in out and "blocks of 16 tokens" in out, out
