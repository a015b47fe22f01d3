"""Where each run of a manifest stands, read from its record and lock without touching either:
done, changed (a finished record made with other settings), damaged (DONE, but its files no
longer match the digests DONE holds), blocked (an entry caramba will not use: a link, a FIFO, a
file where the record belongs), running (its lock is held), failed (an attempt without DONE, or
one whose worker was killed) or pending (no record). See caramba.runs.record_status."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from caramba.runs import RecordError, RunDir, entry_kind, record_status

STATES = ("done", "changed", "damaged", "blocked", "running", "failed", "pending")


@dataclass
class RunState:
    name: str
    state: str
    record: Path
    detail: str = ""


def run_state(record: RunDir, digest: str, locks: set[tuple[int, int, int]] | None = None) -> RunState:
    """The state of one run's record; `locks` from held_locks() (read once for many runs)."""
    name = f"{record.final.parent.name}/{record.final.name}"
    try:
        lock_kind = entry_kind(record.lock_path)
    except RecordError as e:
        return RunState(name, "blocked", record.final, str(e))
    if lock_kind not in (None, "file"):
        return RunState(name, "blocked", record.final, f"the lock {record.lock_path} is a {lock_kind}, not a lock file; "
                                                      "remove it")
    if lock_kind == "file" and lock_held(record.lock_path, locks):
        return RunState(name, "running", record.final, f"pid {record.holder() or '?'}")
    status = record_status(record.final, digest)
    return RunState(name, status.state, record.final, status.detail)


def held_locks() -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of every flock held on this machine, from /proc/locks (Linux);
    None where that file is missing. Reading it takes no lock, so a run starting meanwhile is
    never turned away (as probing its lock could)."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    held = set()
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue   # '->': a process waiting for the lock, not holding it
        try:
            major, minor, inode = fields[5].split(":")
            held.add((int(major, 16), int(minor, 16), int(inode)))
        except ValueError:
            continue
    return held


def lock_held(path: Path, locks: set[tuple[int, int, int]] | None = None) -> bool:
    """Whether some process holds the run lock at `path`."""
    try:
        st = os.lstat(path)   # a link is never a lock (and is not followed)
    except OSError:
        return False
    if locks is None:
        locks = held_locks()
    if locks is not None:
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in locks
    try:   # no /proc/locks: probe with a shared lock, dropped at once
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
