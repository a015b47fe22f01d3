"""The plan store: runs/cache_plans.json, one chosen cache policy per (model, machine, settings).

    {"version": 1, "plans": {"<key id>": {"key": {...}, "chosen": {...}, "candidates": [...],
                                          "created_utc": "...", "created_unix": 1.7e9}}}

The key id is a digest of the key's fields (caramba.autotune.select.plan_key), which are kept
beside it for `caramba plans list`. Every read-modify-write holds an exclusive lock on a sibling
`.lock` file (fcntl; the data file itself is replaced by rename, so it cannot carry the lock), and
the new file is written atomically, so two autotunes finishing at once both keep their entries.
A file that does not parse as a plan store is moved aside to `<name>.corrupt-<UTC time>` and
reported, never overwritten.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from caramba.runs import atomic_write_json, runs_root

VERSION = 1
FILENAME = "cache_plans.json"


def default_plan_path() -> Path:
    """runs/cache_plans.json under the runs root ($CARAMBA_RUNS_DIR or ./runs)."""
    return runs_root() / FILENAME


def key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class PlanStore:
    def __init__(self, path: str | Path | None = None, notice: Callable[[str], None] | None = None) -> None:
        self.path = Path(path) if path is not None else default_plan_path()
        self.notice = notice or (lambda message: None)   # where a moved-aside corrupt file is reported

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, dict]:
        """The plans; a corrupt file is moved aside (the caller holds the lock)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
            if not (isinstance(data, dict) and data.get("version") == VERSION and isinstance(data.get("plans"), dict)
                    and all(isinstance(p, dict) and "chosen" in p for p in data["plans"].values())):
                raise ValueError(f"not a version-{VERSION} plan store")
        except ValueError as e:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            os.replace(self.path, aside)
            self.notice(f"plan file {self.path} is corrupt ({e}); moved it aside to {aside} and started a new one")
            return {}
        return data["plans"]

    def _write(self, plans: dict[str, dict]) -> None:
        atomic_write_json(self.path, {"version": VERSION, "plans": plans})

    def all(self) -> dict[str, dict]:
        with self._locked():
            return self._read()

    def get(self, key: dict[str, Any]) -> dict | None:
        return self.all().get(key_id(key))

    def put(self, key: dict[str, Any], entry: dict[str, Any]) -> dict:
        """Store entry (chosen, candidates, ...) under key, stamped now; returns what was stored."""
        stored = {"key": key, **entry, "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "created_unix": time.time()}
        with self._locked():
            plans = self._read()
            plans[key_id(key)] = stored
            self._write(plans)
        return stored

    def remove(self, ids: list[str] | None = None) -> list[str]:
        """Drop the plans whose id starts with one of ids (all plans when None); the ids dropped."""
        with self._locked():
            plans = self._read()
            gone = [i for i in plans if ids is None or any(i.startswith(p) for p in ids)]
            for i in gone:
                del plans[i]
            if gone:
                self._write(plans)
        return gone


def is_stale(entry: dict, probe: bool, interval_sec: float, now: float | None = None) -> bool:
    """With probing on, a plan older than the interval is re-evaluated."""
    return probe and (now if now is not None else time.time()) - entry.get("created_unix", 0) > interval_sec
