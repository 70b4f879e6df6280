"""This package's server in a child process on 127.0.0.1, for load tests whose client must not share its
interpreter.

Defined in chapter 12 (serving many users). A load-test client in the server's own process takes the
server's GIL for every chunk it parses, and every hand-back of the GIL can wait a whole switch interval
(5 ms by default): on a 2-core CPU that showed as tens of milliseconds per token that no real deployment
pays, since a real client runs elsewhere. ``ServerProcess`` starts ``python -m engine_lib serve`` with
the given options on a free loopback port, waits until ``/health`` answers (bounded), and stops it with
SIGTERM (then SIGKILL) when the block ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(["--model", path, ...]) as url:`` -> ``http://127.0.0.1:PORT`` while it runs."""

    def __init__(self, serve_args: list[str], start_timeout: float = 600.0, log_path: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "engine_lib", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     "--shutdown-timeout", "2", *serve_args]
        self.start_timeout = start_timeout
        # its output, read when it fails to start
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"engine_lib-serve-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        import httpx

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it answered "
                                   f"(its output: {self.log_path})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise TimeoutError(f"the server did not answer /health within {self.start_timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
