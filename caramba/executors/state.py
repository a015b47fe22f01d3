"""Where each run of a manifest stands, read from its record and lock without touching either:
done, changed (a finished record made with other settings), running (its lock is held),
failed (an attempt without DONE) or pending (no record)."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from caramba.runs import RunDir

STATES = ("done", "changed", "running", "failed", "pending")


@dataclass
class RunState:
    name: str
    state: str
    record: Path
    detail: str = ""


def run_state(record: RunDir, digest: str, locks: set[tuple[int, int, int]] | None = None) -> RunState:
    """The state of one run's record; `locks` from held_locks() (read once for many runs)."""
    name = f"{record.final.parent.name}/{record.final.name}"
    if lock_held(record.lock_path, locks):
        return RunState(name, "running", record.final, f"pid {record.holder() or '?'}")
    if record.is_done():
        recorded = record.recorded_hash()
        if recorded == digest:
            return RunState(name, "done", record.final)
        why = "no run hash (an older caramba)" if recorded is None else f"hash {recorded[:12]} -> {digest[:12]}"
        return RunState(name, "changed", record.final, why)
    if record.final.exists():
        return RunState(name, "failed", record.final, _last_line(record.final / "log.txt"))
    return RunState(name, "pending", record.final)


def _last_line(log: Path) -> str:
    try:
        with open(log, "rb") as file:
            file.seek(max(0, os.fstat(file.fileno()).st_size - 4096))
            lines = file.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return "no log"
    failed = [line for line in lines if "FAILED" in line or "interrupted" in line]
    return (failed or lines or ["empty log"])[-1][:200]


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
        st = os.stat(path)
    except OSError:
        return False
    if locks is None:
        locks = held_locks()
    if locks is not None:
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in locks
    try:   # no /proc/locks: probe with a shared lock, dropped at once
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
