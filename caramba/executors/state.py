"""Where each run of a manifest stands, read from its record and lock without touching either:
done, changed (a finished record made with other settings), damaged (DONE, but its files no
longer match the digests DONE holds), blocked (an entry caramba will not use: a link, a FIFO, a
file where the record belongs), running (its lock is held), failed (an attempt without DONE, or
one whose worker was killed) or pending (no record). See caramba.runs.record_status."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from caramba.runs import RunDir, held_locks, lock_held, record_status

__all__ = ["STATES", "RunState", "held_locks", "lock_held", "run_state"]   # the lock helpers live in caramba.runs

STATES = ("done", "changed", "damaged", "blocked", "running", "failed", "pending")


@dataclass
class RunState:
    name: str
    state: str
    record: Path
    detail: str = ""


def run_state(record: RunDir, digest: str, locks: set[tuple[int, int, int]] | None = None) -> RunState:
    """The state of one run's record (caramba.runs.record_status, the lock asked); `locks` from
    held_locks() (read once for many runs)."""
    status = record_status(record.final, digest, locks)
    return RunState(f"{record.final.parent.name}/{record.final.name}", status.state, record.final, status.detail)
