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
import subprocess
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are then not protected against a second process
    fcntl = None

import caramba
from caramba.errors import RunError

DONE = "DONE"
LOG = "log.txt"
STAGING = ".partial"   # .<run id>.partial: the record being built
OLD = ".old"           # .<run id>.old: the record being replaced, for the instant of the swap
LOCK = ".lock"         # .<run id>.lock: the run's lock file (kept: deleting a lock file races)
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
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())   # mkstemp makes 0600; a record is as readable as log.txt
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:  # KeyboardInterrupt included: never leave the temp file behind
        Path(temp).unlink(missing_ok=True)
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


class RunDir:
    """The record directory of one run, its lock and the directory a new record is built in.

    `final` is where the record lives; `path` is where files are written now: the staging
    directory between begin() and finish()/abandon(), `final` otherwise. Runners write through
    `path` and never need to know which it is.
    """

    def __init__(self, manifest_name: str, target: str, run_id: str, root: str | Path | None = None):
        for part in (manifest_name, target, run_id):
            # The manifest schema already insists on safe identifiers; this guards rmtree below.
            if not part or part in (".", "..") or "/" in part or "\\" in part:
                raise ValueError(f"{part!r} cannot name a run directory")
        self.final = runs_root(root) / manifest_name / target / run_id
        self.staging = self.final.parent / f".{run_id}{STAGING}"
        self.lock_path = self.final.parent / f".{run_id}{LOCK}"
        self._old = self.final.parent / f".{run_id}{OLD}"
        self.path = self.final
        self._lock_fd: int | None = None

    @classmethod
    def unique(cls, manifest_name: str, target: str, stem: str, root: str | Path | None = None) -> RunDir:
        """A new, locked record named `stem`, or `stem-2`, `stem-3`, ... when that name is taken
        (two `caramba bench` in the same second): the name is claimed by creating its lock file
        exclusively, which only one process can do."""
        for n in itertools.count(1):
            record = cls(manifest_name, target, stem if n == 1 else f"{stem}-{n}", root)
            record.final.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(record.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                continue
            if record.final.exists():  # a record from before lock files: the name is taken too
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

    def try_lock(self) -> bool:
        """Take this run's lock without waiting; False when another process holds it. Under the
        lock, a swap that a crash cut in half is completed first."""
        if self._lock_fd is not None:
            return True
        self.final.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
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
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)   # who holds it, for the other process's message
        self._lock_fd = fd
        self._recover()

    def holder(self) -> str | None:
        """The pid written by the process holding the lock (None if unknown)."""
        try:
            return self.lock_path.read_text().strip() or None
        except OSError:
            return None

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops the flock)."""
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)

    def _recover(self) -> None:
        """Finish a swap interrupted between its two renames (see _swap_in)."""
        if self._old.exists():
            if self.final.exists():
                shutil.rmtree(self._old, ignore_errors=True)
            else:
                os.rename(self._old, self.final)

    # ---- state -----------------------------------------------------------------------------

    def is_done(self) -> bool:
        """True when a finished record is in place."""
        return (self.final / DONE).is_file()

    def recorded_hash(self) -> str | None:
        """The run hash the finished record was made with (None: none, or made before hashes)."""
        try:
            return json.loads((self.final / "env.json").read_text(encoding="utf-8")).get("run_hash")
        except (OSError, ValueError, AttributeError):
            return None

    # ---- building a record -----------------------------------------------------------------

    def begin(self, force: bool = False) -> None:
        """Start a new record in an empty staging directory, beside any finished one, which stays
        in place until finish(). Without `force` a finished record is refused. Takes the lock if
        this object does not hold it yet."""
        if not self.try_lock():
            raise RunError(f"{self.final} is being written by another process (pid {self.holder() or '?'})")
        if self.is_done() and not force:
            raise RunError(f"{self.final} already holds a finished run; use --force to redo it")
        if self.staging.exists():  # an attempt that died before finishing: its files mean nothing
            shutil.rmtree(self.staging)
        self.staging.mkdir(parents=True)
        self.path = self.staging

    def write_text(self, name: str, text: str) -> Path:
        atomic_write_text(self.path / name, text)
        return self.path / name

    def write_json(self, name: str, obj: Any) -> Path:
        atomic_write_json(self.path / name, obj)
        return self.path / name

    def log(self, message: str) -> None:
        """Append timestamped lines to log.txt, flushed at once so a crash keeps them."""
        with open(self.path / LOG, "a", encoding="utf-8") as file:
            stamp = utc_now()
            for line in message.splitlines() or [""]:
                file.write(f"{stamp} {line}\n")
            file.flush()

    def finish(self) -> None:
        """Mark the new record complete and swap it in for the old one; call after every other
        file is written."""
        atomic_write_text(self.path / DONE, utc_now() + "\n")
        if self.path == self.staging:
            self._swap_in()

    def abandon(self) -> Path:
        """A failed or interrupted attempt. A finished record stays untouched and the attempt is
        left in the staging directory (its log there; the next attempt clears it); with no
        finished record to keep, the attempt takes the record's place, without DONE. Returns
        where the attempt's files are."""
        if self.path != self.staging:
            return self.path
        if self.is_done():
            return self.staging
        self._swap_in()
        return self.final

    def discard(self) -> None:
        """Drop the attempt: its input turned out bad, so nothing of it is kept (a finished
        record stays)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.path = self.final

    def _swap_in(self) -> None:
        # Two renames; a crash between them leaves .old and no record, which _recover() undoes.
        if self.final.exists():
            os.rename(self.final, self._old)
        os.rename(self.staging, self.final)
        _fsync_dir(self.final.parent)
        shutil.rmtree(self._old, ignore_errors=True)
        self.path = self.final


def capture_env(seed: int | None, device: str) -> dict[str, Any]:
    """What a reader needs to reproduce or compare a run, without personal data (no hostname)."""
    env: dict[str, Any] = {
        "timestamp_utc": utc_now(),
        "caramba_version": caramba.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
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
    cuda = bool(torch and torch.cuda.is_available())
    env["cuda_version"] = torch.version.cuda if torch else None
    env["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    env["kernel_isa"] = __import__("caramba.model.isa", fromlist=["isa"]).kernel_isa() if torch else None
    return env


def _cpu_model() -> str | None:
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
