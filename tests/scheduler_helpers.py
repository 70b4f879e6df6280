"""Shared by the scheduler tests (no HTTP): what the runner was asked to prefill, and a run to the end."""

import time

from engine_lib.loop.model_runner import ModelRunner


def prefill_rows(monkeypatch) -> list[int]:
    """The rows of every prefill forward the scheduler runs from now on, in order."""
    seen, real = [], ModelRunner.execute

    def recording(self, batch):
        if batch.prefill:
            seen.append(len(batch.rows))
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    return seen


def wait_done(seqs, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(s.done for s in seqs):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def wait_tokens(seq, n: int, timeout: float = 60.0) -> None:
    """Wait until a running sequence has made ``n`` tokens."""
    deadline = time.monotonic() + timeout
    while len(seq.output_ids) < n:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def run_queued(sched, seqs, timeout: float = 60.0) -> None:
    """Queue every sequence before the loop starts (its first step admits them together), run
    the loop until they are all done, and stop it."""
    for seq in seqs:
        sched.submit(seq)
    sched.start()
    try:
        wait_done(seqs, timeout)
    finally:
        sched.stop()
