"""``python -m engine_lib serve`` as a subprocess on 127.0.0.1: it starts, streams, refuses a wrong
key (given on the command line or in the environment), and stops when told to: draining for
``--shutdown-timeout`` then cancelling, or at once on a second signal."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from engine_lib.bench.server_process import free_port

pytest.importorskip("fastapi")


def test_serve_help():
    out = subprocess.run([sys.executable, "-m", "engine_lib", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--api-key", "--kv-cache-gib", "--stage", "--max-batch", "--max-queue",
                 "--shutdown-timeout", "--metrics-no-auth", "--decode-steps", "--speculative", "ENGINE_LIB_API_KEY"):
        assert flag in out.stdout


@pytest.mark.parametrize("flag,said", [("--decode-steps", "decode_steps must be a whole number >= 1, got 0"),
                                       ("--speculative-tokens", "speculative_tokens must be a whole number >= 1, got 0")])
def test_a_bad_serving_option_is_refused_before_the_model_loads(flag, said):
    out = subprocess.run([sys.executable, "-m", "engine_lib", "serve", "--model", "no/such-model", flag, "0"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0
    assert said in out.stderr and "Traceback" not in out.stderr


def test_a_port_in_use_fails_with_status_1(tiny_dir):
    """The HTTP server runs in a thread (the scheduler's loop has the main one): its failure to bind must still
    end the process with a failing status, not a clean 0."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = subprocess.run([sys.executable, "-m", "engine_lib", "serve", "--model", str(tiny_dir), "--port",
                              str(taken.getsockname()[1]), "--kv-cache-gib", "0.05"], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1, out.stderr[-2000:]
    assert "address already in use" in out.stderr


def test_serve_subprocess_streams_and_stops(tiny_dir):
    proc, url = launch(tiny_dir, "--api-key", "k")
    try:
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


def launch(tiny_dir, *flags, env=None):
    """A server subprocess on 127.0.0.1 -> (process, url) once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "engine_lib", "serve", "--model", str(tiny_dir), "--port", str(port),
           "--kv-cache-gib", "0.05", "--served-model-name", "tiny", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)


def stop_quietly(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3000, "temperature": 0,
        "stream": True}


def signal_mid_stream(proc, url, headers, then):
    """Read a long stream; after 3 chunks call ``then()`` and keep reading (breaking off would close the
    connection, and the server would cancel it as a client gone) until the stream breaks.
    -> (seconds from then() to the process's exit, chunks received after then())."""
    got, after, start = 0, 0, None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=LONG, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                got += line.startswith("data: {")
                after += start is not None and line.startswith("data: {")
                if got == 3 and start is None:
                    start = time.monotonic()
                    then()
    except httpx.HTTPError:
        pass  # the server went away mid-stream
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    return time.monotonic() - start, after


def test_shutdown_drains_then_cancels_and_the_key_comes_from_the_environment(tiny_dir):
    """SIGTERM with a 3,000-token stream running: the server waits --shutdown-timeout (1 s), cancels,
    and exits; the key set in ENGINE_LIB_API_KEY guards the routes; /metrics is open with --metrics-no-auth."""
    proc, url = launch(tiny_dir, "--shutdown-timeout", "1", "--metrics-no-auth", env={"ENGINE_LIB_API_KEY": "envkey"})
    try:
        body = {**LONG, "max_tokens": 2, "stream": False}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 401
        ok = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer envkey"}, timeout=30)
        assert ok.status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        took, after = signal_mid_stream(proc, url, {"Authorization": "Bearer envkey"},
                                        lambda: proc.send_signal(signal.SIGTERM))
        assert proc.poll() is not None, "still running 30 s after SIGTERM"
        assert after > 0, "the running stream was not drained"
        assert 1 <= took < 15, f"exit took {took:.1f} s with --shutdown-timeout 1"
    finally:
        stop_quietly(proc)
    assert "signal again to exit now" in proc.stdout.read()


def test_second_signal_exits_at_once(tiny_dir):
    proc, url = launch(tiny_dir, "--shutdown-timeout", "300")

    def twice():
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)

    try:
        took, _ = signal_mid_stream(proc, url, {}, twice)
        assert proc.poll() is not None and took < 10, f"{took:.1f} s after the second SIGTERM, with a 300 s drain"
    finally:
        stop_quietly(proc)
    assert "second signal: exiting now" in proc.stdout.read()
