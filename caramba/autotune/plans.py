"""The plan store: runs/cache_plans.json, one chosen cache policy per (model, machine, settings).

    {"version": 1, "plans": {"<key id>": {"key": {...}, "chosen": {...}, "candidates": [...],
                                          "created_utc": "...", "created_unix": 1.7e9}}}

The key id is a digest of the key's fields (caramba.autotune.select.plan_key), which are kept
beside it for `caramba plans list`. The default name starts with a dot so that no manifest (whose
name names a directory under runs/ and cannot start with one) collides with it.

Every read-modify-write holds an exclusive lock on a sibling `.lock` file (fcntl; the data file
itself is replaced by rename, so it cannot carry the lock), and the new file is written
atomically, so two autotunes finishing at once both keep their entries. Reads take no lock and
write nothing: a reader sees the old file or the whole new one.

A file that does not parse as a plan store is never overwritten. Reading reports it and sees no
plans. Writing moves it aside to `<name>.corrupt-<UTC time>` only when it is recognizably a
damaged plan store (under the runs root, or JSON with the store's `version`/`plans` fields);
any other file (a path given by mistake: a config, a binary, a directory) is refused with a
UserError and left as it is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from caramba.errors import UserError
from caramba.runs import atomic_write_json, runs_root

VERSION = 1
FILENAME = "cache_plans.json"
MAX_BYTES = 64 << 20  # a store of thousands of plans is a few MiB


def default_plan_path() -> Path:
    """runs/cache_plans.json under the runs root ($CARAMBA_RUNS_DIR or ./runs)."""
    return runs_root() / FILENAME


def key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def is_under(path: Path, root: Path) -> bool:
    """Whether path (resolved, symlinks followed) lies inside root."""
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


class _Damaged(Exception):
    def __init__(self, why: str, recognizable: bool) -> None:
        super().__init__(why)
        self.recognizable = recognizable   # a damaged plan store (may be set aside), not some other file


class PlanStore:
    def __init__(self, path: str | Path | None = None, notice: Callable[[str], None] | None = None) -> None:
        self.path = Path(path) if path is not None else default_plan_path()
        self.notice = notice or (lambda message: None)   # where a damaged store is reported

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        try:  # non-blocking open: a FIFO planted as the lock must not hang us
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise UserError(f"cannot open the plan store's lock {lock_path}: {e.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UserError(f"{lock_path} is not a regular file; remove it, or give another plan path")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _load(self) -> dict[str, dict]:
        """The plans, or _Damaged saying why the file is not a plan store."""
        try:
            return self._parse()
        except (OSError, ValueError) as e:  # unreadable, a name too long, a NUL in the path
            raise UserError(f"cannot read the plan store {self.path}: {getattr(e, 'strerror', None) or e}") from None

    def _parse(self) -> dict[str, dict]:
        if not self.path.exists() and not self.path.is_symlink():
            return {}
        if not self.path.is_file():
            raise _Damaged("it is not a regular file" + (" but a directory" if self.path.is_dir() else ""), False)
        with open(self.path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise _Damaged(f"it is over {MAX_BYTES >> 20} MiB", False)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _Damaged(f"not JSON: {e}", False) from None
        shaped = isinstance(data, dict) and ("plans" in data or "version" in data)
        if not (isinstance(data, dict) and data.get("version") == VERSION and isinstance(data.get("plans"), dict)):
            raise _Damaged(f"not a version-{VERSION} plan store", shaped)
        for pid, plan in data["plans"].items():
            # What readers index without checking (autotune's reuse, `plans list`): the fields put() writes.
            if not (isinstance(plan, dict) and isinstance(plan.get("key"), dict) and isinstance(plan.get("chosen"), dict)
                    and isinstance(plan["chosen"].get("name"), str) and isinstance(plan.get("candidates"), list)
                    and isinstance(plan.get("created_utc"), str)):
                raise _Damaged(f"plan {pid!r} lacks its key, chosen cache, candidates or creation time", True)
        return data["plans"]

    def _ours(self, damage: _Damaged) -> bool:
        return damage.recognizable or (self.path.is_file() and is_under(self.path, runs_root()))

    def _refuse_foreign(self) -> None:
        """Before taking the lock (which creates a file beside the store): refuse a path that holds
        something other than a plan store, so a refused write leaves nothing behind."""
        try:
            self._load()
        except _Damaged as e:
            if not self._ours(e):
                raise UserError(f"{self.path} is not a plan store ({e}); caramba will not overwrite it: "
                                "give another plan path (a new file, or one under runs/)") from None

    def _read_for_write(self) -> dict[str, dict]:
        """The plans before a write (the caller holds the lock): a damaged store is moved aside;
        a file that is not recognizably one is refused, untouched."""
        try:
            return self._load()
        except _Damaged as e:
            if not self._ours(e):
                raise UserError(f"{self.path} is not a plan store ({e}); caramba will not overwrite it: "
                                "give another plan path (a new file, or one under runs/)") from None
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            os.replace(self.path, aside)
            self.notice(f"plan file {self.path} is corrupt ({e}); moved it aside to {aside} and started a new one")
            return {}

    def _write(self, plans: dict[str, dict]) -> None:
        atomic_write_json(self.path, {"version": VERSION, "plans": plans})

    def all(self) -> dict[str, dict]:
        """The stored plans; a damaged store is reported and reads as empty (nothing is moved)."""
        try:
            return self._load()
        except _Damaged as e:
            self.notice(f"plan file {self.path} is corrupt or not a plan store ({e}); ignoring it. "
                        "The next autotune that stores a plan there moves a damaged store aside")
            return {}

    def get(self, key: dict[str, Any]) -> dict | None:
        return self.all().get(key_id(key))

    def put(self, key: dict[str, Any], entry: dict[str, Any]) -> dict:
        """Store entry (chosen, candidates, ...) under key, stamped now; returns what was stored."""
        stored = {"key": key, **entry, "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "created_unix": time.time()}
        self._refuse_foreign()
        with self._locked():
            plans = self._read_for_write()
            plans[key_id(key)] = stored
            self._write(plans)
        return stored

    def remove(self, ids: list[str] | None = None) -> list[str]:
        """Drop the plans whose id starts with one of ids (all plans when None); the ids dropped."""
        if ids is not None and not all(isinstance(i, str) and i.strip() for i in ids):
            raise ValueError("an empty plan id would match every plan; give ids from `caramba plans list`, "
                             "or no id to clear them all")
        if not self.path.exists():
            return []
        self._refuse_foreign()
        with self._locked():
            plans = self._read_for_write()
            gone = [i for i in plans if ids is None or any(i.startswith(p) for p in ids)]
            for i in gone:
                del plans[i]
            if gone:
                self._write(plans)
        return gone


def is_stale(entry: dict, probe: bool, interval_sec: float, now: float | None = None) -> bool:
    """With probing on, a plan older than the interval is re-evaluated."""
    return probe and (now if now is not None else time.time()) - entry.get("created_unix", 0) > interval_sec
