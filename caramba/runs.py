"""Run records: one directory per run, written so that a crash never looks like a result.

Layout: `<runs root>/<manifest name>/<target>/<run id>/` holding `manifest.yaml` (resolved),
`env.json`, `result.json`, `log.txt` and `DONE`. A new record is built aside, in
`.<run id>.partial/` beside it, every file written atomically (temp file, fsync, rename) and
`DONE` last; only then is it swapped in for the old one. So an interrupted attempt, forced
or not, never costs the finished record. With no finished record to keep, a failed attempt
takes the record's place without `DONE` (an incomplete run, redone next time) so its log is
where the reader looks.

Each run is locked while it is looked at or built: an OS lock (fcntl.flock) on
`.<run id>.lock` beside the record, held by one process at a time and dropped by the kernel
when that process dies. A second `caramba run` skips a run that another one holds.

A record carries its run's hash (`run_hash` in env.json and result.json, see `run_hash`):
a finished record is reused only when the hash matches the run as it stands now.
The runs root is `./runs`, or `$CARAMBA_RUNS_DIR`, or an explicit argument.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are then not protected against a second process
    fcntl = None

from caramba import kernels, threads
from caramba.errors import RunError
from caramba.version import __version__

DONE = "DONE"
LOG = "log.txt"
STAGING = ".partial"   # .<run id>.partial: the record being built
OLD = ".old"           # .<run id>.old: the record being replaced, for the instant of the swap
LOCK = ".lock"         # .<run id>.lock: the run's lock file (kept: deleting a lock file races)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)   # 0 on Windows, which has no symlinks to speak of here
# The libraries besides torch whose versions can change a run's numbers or tokens.
RESULT_LIBRARIES = ("torch", "transformers", "tokenizers", "gguf", "numpy", "safetensors")


def runs_root(root: str | Path | None = None) -> Path:
    """The directory that holds all run records: `root`, else $CARAMBA_RUNS_DIR, else ./runs."""
    return Path(root or os.environ.get("CARAMBA_RUNS_DIR") or "runs")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _umask() -> int:
    mask = os.umask(0o022)   # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never a part."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """atomic_write_text's bytes: readers see the old file or the whole new one, never a part."""
    path = Path(path)
    try:
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:   # name the file asked for, not the temp name nobody asked about
        raise type(e)(e.errno, e.strerror, str(path)) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())   # mkstemp makes 0600; a record is as readable as log.txt
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)   # replaces a link at `path` itself, never what it points to
    except BaseException as e:  # KeyboardInterrupt included: never leave the temp file behind
        Path(temp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None:   # ENOSPC, EROFS: say which file
            raise type(e)(e.errno, e.strerror, str(path)) from None
        raise
    _fsync_dir(path.parent)  # make the rename itself durable


def json_text(obj: Any, **kwargs: Any) -> str:
    """json.dumps that every parser reads: NaN and infinities (a score of -inf, a failed metric)
    become null (json.dumps would write NaN, which is not JSON)."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def atomic_write_json(path: str | Path, obj: Any) -> None:
    # Serialise first, so an unserialisable object fails before any file is touched.
    atomic_write_text(path, json_text(obj, indent=2, ensure_ascii=False) + "\n")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_hash(identity: dict[str, Any]) -> str:
    """sha256 of a run's identity (canonical JSON): what must match for a record to be reused."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def library_versions() -> dict[str, str | None]:
    """Installed versions of the libraries that shape results (None: not installed); read from
    package metadata, so nothing is imported."""
    versions: dict[str, str | None] = {}
    for name in RESULT_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


class RecordError(RunError):
    """An entry of a run's record that is not what caramba put there (a link, a FIFO, a file where
    a directory belongs, ...), or a filesystem that refuses a write: that run fails, named, with
    the path; the other runs go on."""


def entry_kind(path: Path) -> str | None:
    """What `path` is, without following a link: None (nothing there), 'directory', 'file',
    'symbolic link', 'FIFO', 'socket' or 'device'."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:   # e.g. a parent that is a file: ENOTDIR
        raise RecordError(f"cannot look at {path}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def _describe(path: Path, kind: str) -> str:
    if kind == "symbolic link":
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    return f"a {kind}"


def read_record_file(path: Path, limit: int = 1 << 30) -> bytes:
    """The bytes of a file inside a record, never following a link and never blocking on a FIFO:
    RecordError naming the path when it is not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RecordError(f"{path} is missing") from None
    except OSError as e:
        kind = entry_kind(path)
        what = _describe(path, kind) if kind and kind != "file" else e.strerror
        raise RecordError(f"{path} is {what}, not a file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordError(f"{path} is a {entry_kind(path) or 'special file'}, not a file")
        if st.st_size > limit:
            raise RecordError(f"{path} is {st.st_size} bytes, more than a record file holds")
        with os.fdopen(os.dup(fd), "rb") as file:
            return file.read()
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """sha256 of a regular file inside a record (RecordError when it is missing or not a file)."""
    return hashlib.sha256(read_record_file(path)).hexdigest()


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
    if fcntl is None:   # Windows: no flock, so no lock is ever held
        return False
    try:   # no /proc/locks: probe with a shared lock, dropped at once
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _holder(lock: Path) -> str | None:
    """The pid the process holding a run's lock wrote in it (None if unknown)."""
    try:
        return read_record_file(lock, 64).decode().strip() or None
    except (RecordError, UnicodeDecodeError):
        return None


@dataclass
class RecordStatus:
    """What a run's record is, read without a lock: done (DONE and its digests hold, and the run
    hash matches when one is given), changed (done, but made with other settings), damaged (DONE,
    but a file it vouches for is missing, changed or not a file), blocked (the record path, or an
    entry beside it, is something caramba will not use: a link, a FIFO, a file where the record
    directory belongs), running (a live process holds the run's lock: what is there is its work in
    progress), failed (an attempt without DONE, or one that died: its staging directory is left)
    or pending (nothing yet)."""

    state: str
    detail: str = ""


def record_status(final: Path, digest: str | None = None, locks: set[tuple[int, int, int]] | None = None, *,
                  running: bool = True) -> RecordStatus:
    """The status of the record at `final` (see RecordStatus); never raises for what it finds.
    locks: held_locks(), read once for many runs. running=False: the record itself, whoever holds
    the lock (for the lock's holder, who is the one running it)."""
    try:
        kind = entry_kind(final)
    except RecordError as e:
        return RecordStatus("blocked", str(e))
    lock = final.parent / f".{final.name}{LOCK}"
    lock_kind = entry_kind(lock) if _lexists(lock) else None
    if lock_kind not in (None, "file"):
        return RecordStatus("blocked", f"the lock {lock} is {_describe(lock, lock_kind)}, not a lock file; caramba "
                                       "will not open it: remove it and run again")
    if lock_kind == "file" and _links(lock) > 1:
        return RecordStatus("blocked", f"the lock {lock} is a hard link to another file; remove it and run again")
    if running and lock_kind == "file" and lock_held(lock, locks):
        return RecordStatus("running", f"pid {_holder(lock) or '?'}")
    staging = final.parent / f".{final.name}{STAGING}"
    if kind is None:
        if _lexists(staging):   # an attempt that died mid-run (a killed worker): no record, but not pending
            return RecordStatus("failed", f"an attempt died before finishing (its files are in {staging})")
        return RecordStatus("pending")
    if kind != "directory":
        return RecordStatus("blocked", f"{final} is {_describe(final, kind)}, not a record directory; "
                                       "caramba will not follow or replace it: remove it and run again")
    if not _lexists(final / DONE):
        return RecordStatus("failed", _last_line(final / LOG))
    damage = record_damage(final)
    if damage is not None:
        return RecordStatus("damaged", damage)
    if digest is not None:
        recorded = recorded_hash(final)
        if recorded != digest:
            why = ("the record has no run hash (made by an older caramba)" if recorded is None
                   else f"run hash {recorded[:12]} -> {digest[:12]}")
            return RecordStatus("changed", why)
    return RecordStatus("done")


def record_damage(final: Path) -> str | None:
    """None when DONE's digests match the record's files; else what is wrong, in a few words."""
    try:
        done = json.loads(read_record_file(final / DONE, 1 << 20))
    except RecordError as e:
        return str(e)
    except (UnicodeDecodeError, json.JSONDecodeError):
        done = None
    files = done.get("files") if isinstance(done, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{final / DONE} lists no file digests (made by an older caramba, or damaged)"
    for name, expected in files.items():
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            return f"{final / DONE} names {name!r}, which is not a file of the record"
        try:
            actual = file_sha256(final / name)
        except RecordError as e:
            return str(e)
        if actual != expected:
            return f"{final / name} does not match the sha256 DONE recorded (changed or truncated since)"
    return None


def recorded_hash(final: Path) -> str | None:
    """The run hash a record was made with (None: none, unreadable, or made before hashes)."""
    try:
        value = json.loads(read_record_file(final / "env.json", 1 << 24)).get("run_hash")
    except (RecordError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def read_record_json(final: Path, name: str = "result.json") -> Any:
    """A record's JSON file; RecordError naming it when it is not a file or not JSON."""
    path = final / name
    try:
        return json.loads(read_record_file(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{path} is not valid JSON ({e})") from None


def _last_line(log: Path) -> str:
    """The line of a failed attempt's log that says why (its last FAILED/interrupted line)."""
    try:
        data = read_record_file(log)
    except RecordError:
        return "no log"
    lines = data[-4096:].decode("utf-8", "replace").strip().splitlines()
    failed = [line for line in lines if "FAILED" in line or "interrupted" in line]
    return (failed or lines or ["empty log"])[-1][:200]


def _links(path: Path) -> int:
    try:
        return os.lstat(path).st_nlink
    except OSError:
        return 1


def _lexists(path: Path) -> bool:
    return os.path.lexists(path)


def _remove_entry(path: Path) -> str | None:
    """Remove a scratch entry (.partial, .old) whatever it is, never following a link: a directory
    is removed with its contents (rmtree does not follow links inside), anything else unlinked.
    Returns what it was when it was not the directory caramba makes there (for a notice)."""
    kind = entry_kind(path)
    if kind is None:
        return None
    try:
        if kind == "directory":
            shutil.rmtree(path)
            return None
        os.unlink(path)
    except OSError as e:
        raise RecordError(f"cannot remove {path} ({kind}): {e.strerror}") from None
    return _describe(path, kind)


class RunDir:
    """The record directory of one run, its lock and the directory a new record is built in.

    `final` is where the record lives; `path` is where files are written now: the staging
    directory between begin() and finish()/abandon(), `final` otherwise. Runners write through
    `path` and never need to know which it is.

    Nothing here follows a link below the runs root: every entry is looked at (lstat) before it
    is used and files are opened with O_NOFOLLOW. An entry that is not what caramba puts there is
    a RecordError naming it, except the scratch entries (.partial, .old), whose contents mean
    nothing and which are removed whatever they are (the link itself, never its target).
    """

    def __init__(self, manifest_name: str, target: str, run_id: str, root: str | Path | None = None):
        for part in (manifest_name, target, run_id):
            # The manifest schema already insists on safe identifiers; this guards rmtree below.
            if not part or part in (".", "..") or "/" in part or "\\" in part:
                raise ValueError(f"{part!r} cannot name a run directory")
        self.root = runs_root(root)
        self.final = self.root / manifest_name / target / run_id
        self.staging = self.final.parent / f".{run_id}{STAGING}"
        self.lock_path = self.final.parent / f".{run_id}{LOCK}"
        self._old = self.final.parent / f".{run_id}{OLD}"
        self.path = self.final
        self._lock_fd: int | None = None
        self.notices: list[str] = []   # scratch entries that were removed, for the runner to print

    @classmethod
    def unique(cls, manifest_name: str, target: str, stem: str, root: str | Path | None = None) -> RunDir:
        """A new, locked record named `stem`, or `stem-2`, `stem-3`, ... when that name is taken
        (two `caramba bench` in the same second): the name is claimed by creating its lock file
        exclusively, which only one process can do."""
        for n in itertools.count(1):
            record = cls(manifest_name, target, stem if n == 1 else f"{stem}-{n}", root)
            record._make_parents()
            try:
                fd = os.open(record.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)
            except FileExistsError:
                continue
            if _lexists(record.final):  # a record from before lock files: the name is taken too
                os.close(fd)
                continue
            record._hold(fd)
            return record
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"RunDir({str(self.final)!r})"

    def __del__(self) -> None:
        self.release()

    # ---- the lock ------------------------------------------------------------------------

    def _make_parents(self) -> None:
        """runs/<manifest>/<target>, each a real directory (the runs root itself may be a link:
        that is where the user put it)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecordError(f"cannot create the runs directory {self.root}: {e.strerror}") from None
        for directory in (self.final.parent.parent, self.final.parent):
            try:
                os.mkdir(directory)
            except FileExistsError:
                pass
            except OSError as e:
                raise RecordError(f"cannot create {directory}: {e.strerror}") from None
            kind = entry_kind(directory)
            if kind != "directory":
                raise RecordError(f"{directory} is {_describe(directory, kind)}, not a directory of records; "
                                  "caramba will not follow or replace it: remove it and run again")

    def try_lock(self) -> bool:
        """Take this run's lock without waiting; False when another process holds it. Under the
        lock, a swap that a crash cut in half is completed first. RecordError when the lock path
        is not a regular file (a link, a directory, a FIFO): caramba never opens through it."""
        if self._lock_fd is not None:
            return True
        self._make_parents()
        kind = entry_kind(self.lock_path)
        if kind not in (None, "file"):
            raise RecordError(f"the lock {self.lock_path} is {_describe(self.lock_path, kind)}, not a lock file; "
                              "caramba will not open it: remove it and run again")
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as e:
            raise RecordError(f"cannot open the lock {self.lock_path}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):   # swapped in between the look and the open
            os.close(fd)
            raise RecordError(f"the lock {self.lock_path} is not a regular file; remove it and run again")
        if st.st_nlink > 1:   # a hard link to a file elsewhere: writing the pid would truncate that file
            os.close(fd)
            raise RecordError(f"the lock {self.lock_path} is a hard link ({st.st_nlink} names for one file), not a "
                              "lock file; caramba will not write it: remove it and run again")
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
        self._hold(fd)
        return True

    def _hold(self, fd: int) -> None:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # immediate: the caller made this fd
        self._lock_fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)   # who holds it, for the other process's message
            self._recover()
        except OSError as e:   # a full or read-only disk: the run fails, named, and the lock is dropped
            self.release()
            raise RecordError(f"cannot write the lock {self.lock_path}: {e.strerror}") from None
        except RecordError:
            self.release()
            raise

    def holder(self) -> str | None:
        """The pid written by the process holding the lock (None if unknown)."""
        return _holder(self.lock_path)

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops the flock)."""
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)

    def _recover(self) -> None:
        """Finish a swap interrupted between its two renames (see _swap_in); a .old that is not
        the directory a swap leaves is scratch and is removed."""
        kind = entry_kind(self._old)
        if kind == "directory" and not _lexists(self.final):
            os.rename(self._old, self.final)
        elif kind is not None:
            self._note(self._old, _remove_entry(self._old))

    def _note(self, path: Path, what: str | None) -> None:
        if what is not None:
            self.notices.append(f"removed {path}: it was {what}, not the directory caramba makes there")

    # ---- state -----------------------------------------------------------------------------

    def status(self, digest: str | None = None) -> RecordStatus:
        """See record_status: the record itself, as the lock's holder (who is running it) sees it;
        a reader outside the lock asks record_status, which says `running` while a process holds it."""
        return record_status(self.final, digest, running=False)

    def is_done(self) -> bool:
        """True when a finished record is in place and its files match DONE's digests."""
        return self.status().state == "done"

    def recorded_hash(self) -> str | None:
        """The run hash the finished record was made with (None: none, or made before hashes)."""
        return recorded_hash(self.final)

    # ---- building a record -----------------------------------------------------------------

    def begin(self, force: bool = False) -> None:
        """Start a new record in an empty staging directory, beside any finished one, which stays
        in place until finish(). Without `force` a finished record is refused. Takes the lock if
        this object does not hold it yet. RecordError when the record path is not a directory."""
        if not self.try_lock():
            raise RunError(f"{self.final} is being written by another process (pid {self.holder() or '?'})")
        status = self.status()
        if status.state == "blocked":
            raise RecordError(status.detail)
        if status.state == "done" and not force:
            raise RunError(f"{self.final} already holds a finished run; use --force to redo it")
        # an attempt that died before finishing: its files mean nothing
        self._note(self.staging, _remove_entry(self.staging))
        self.path = self.staging   # before mkdir: an interrupt just after it finds the attempt where it is
        try:
            os.mkdir(self.staging)
        except OSError as e:
            self.path = self.final
            raise RecordError(f"cannot create {self.staging}: {e.strerror}") from None

    def write_text(self, name: str, text: str) -> Path:
        atomic_write_text(self.path / name, text)
        return self.path / name

    def write_json(self, name: str, obj: Any) -> Path:
        atomic_write_json(self.path / name, obj)
        return self.path / name

    def log(self, message: str) -> None:
        """Append timestamped lines to log.txt, flushed at once so a crash keeps them."""
        path = self.path / LOG
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as e:
            raise RecordError(f"cannot write {path}: {e.strerror}") from None
        with os.fdopen(fd, "a", encoding="utf-8") as file:
            stamp = utc_now()
            try:
                for line in message.splitlines() or [""]:
                    file.write(f"{stamp} {line}\n")
                file.flush()
            except OSError as e:
                raise RecordError(f"cannot write {path}: {e.strerror}") from None

    def finish(self) -> None:
        """Mark the new record complete and swap it in for the old one; call after every other
        file is written. DONE holds the sha256 of every file it vouches for (all but the log,
        which a later attempt may append to), so a record later truncated or edited shows as
        damaged instead of done."""
        files = {}
        for entry in sorted(os.listdir(self.path)):
            if entry not in (DONE, LOG) and entry_kind(self.path / entry) == "file":
                files[entry] = file_sha256(self.path / entry)
        atomic_write_text(self.path / DONE, json_text({"finished_utc": utc_now(), "files": files}, indent=1) + "\n")
        if self.path == self.staging:
            self._swap_in()

    def abandon(self) -> Path:
        """A failed or interrupted attempt. A finished record stays untouched and the attempt is
        left in the staging directory (its log there; the next attempt clears it); with no
        finished record to keep, the attempt takes the record's place, without DONE. Returns
        where the attempt's files are (the staging directory also when the swap itself fails:
        a read-only or full disk)."""
        if self.path != self.staging:
            return self.path
        if self.status().state in ("done", "changed", "blocked"):
            return self.staging
        try:
            self._swap_in()
        except (OSError, RecordError):
            return self.staging
        return self.final

    def discard(self) -> None:
        """Drop the attempt: its input turned out bad, so nothing of it is kept (a finished
        record stays)."""
        try:
            _remove_entry(self.staging)
        except RecordError:
            pass
        self.path = self.final

    def _swap_in(self) -> None:
        # Two renames; a crash between them leaves .old and no record, which _recover() undoes.
        kind = entry_kind(self.final)
        if kind not in (None, "directory"):
            raise RecordError(f"{self.final} is {_describe(self.final, kind)}, not a record directory")
        try:
            if kind is not None:
                self._note(self._old, _remove_entry(self._old))
                os.rename(self.final, self._old)
            os.rename(self.staging, self.final)
        except OSError as e:
            raise RecordError(f"cannot move the new record into {self.final}: {e.strerror}") from None
        _fsync_dir(self.final.parent)
        self.path = self.final
        try:
            _remove_entry(self._old)
        except RecordError:
            pass   # the next lock holder removes it (_recover)


def capture_env(seed: int | None, device: str) -> dict[str, Any]:
    """What a reader needs to reproduce or compare a run, without personal data (no hostname)."""
    env: dict[str, Any] = {
        "timestamp_utc": utc_now(),
        "caramba_version": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "seed": seed,
        "device": device,
        "git": _git_state(),
    }
    try:
        import torch  # lazily: the record module should not cost a torch import to load
    except ImportError:
        torch = None
    env["torch_version"] = torch.__version__ if torch else None
    env["torch_threads"] = torch.get_num_threads() if torch else None
    env["threads"] = threads.record() if torch else None   # threads asked, used and why
    cuda = bool(torch and torch.cuda.is_available())
    env["cuda_version"] = torch.version.cuda if torch else None
    env["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    # lazy: keeps --help free of torch (the CLI imports this module)
    env["kernel_isa"] = __import__("caramba.model.isa", fromlist=["isa"]).kernel_isa() if torch else None
    # whether the fused C decode step can run here ('c', else why not); the decoders choose it per
    # session (caramba.model.backend), and bench cells and generate rows say which path their steps took
    # lazy: keeps --help free of torch (the CLI imports this module)
    env["decode_step"] = __import__("caramba.model.fast_decode", fromlist=["status"]).status() if torch else None
    # the quantized prefill's GEMM level (amx, vnni, ...: caramba.model.quant_gemm)
    # lazy: keeps --help free of torch (the CLI imports this module)
    env["prefill_gemm"] = __import__("caramba.model.quant_gemm", fromlist=["level"]).level() if torch else None
    # every C library: 'c', or why its callers took the eager path (an install without the kernels is
    # 35x slower at q8_0 decode, so a record must say)
    env["kernels"] = kernel_status() if torch else None
    # where each loaded library came from: "prebuilt <variant>" (the install's) or "built here"
    env["kernel_builds"] = kernel_builds() if torch else None
    # glibc's thresholds for freed memory (caramba.model.heap), set here already where a CPU model's
    # load will set them (the record is begun before the model loads): ~10% of a prefill's time
    # lazy: the caramba.model package imports torch; keeps --help free of it (the CLI imports this module)
    heap = __import__("caramba.model.heap", fromlist=["status"])
    on_cpu = torch is not None and (device == "cpu" or (device == "auto" and not cuda))
    env["heap"] = heap.keep_freed() if on_cpu else heap.status()
    return env


def kernel_builds() -> dict[str, str]:
    """Each loaded C library's origin (caramba.kernels.origin): "prebuilt <variant>" from the
    install (setup.py), or "built here" at run time (-march=native, an editable install)."""
    kernel_status()   # loads every library, so each has an origin
    return dict(sorted(kernels.origin.items()))


def kernel_status() -> dict[str, str]:
    """Each C kernel library's status ('c', else why not: caramba.kernels), by what it runs."""
    from caramba.cache import kernel   # lazy: keeps --help free of torch (the CLI imports this module)
    from caramba import fused   # lazy: keeps --help free of torch
    from caramba.model import fast_decode, quant, quant_gemm   # lazy: keeps --help free of torch

    return {"decode_step": fast_decode.status(), "quant_weights": quant.status(),
            "quant_prefill": quant_gemm.library.status(), "kv_attention": kernel.status(),
            "decode_ops": fused.status()}


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git_state() -> dict[str, Any] | None:
    """{'sha', 'dirty'} of the repository around the working directory, or None outside one."""
    sha = _git("rev-parse", "HEAD")
    if sha is None:
        return None
    status = _git("status", "--porcelain")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
