"""Run records: one directory per run, written so that a crash never looks like a result.

Layout: `<runs root>/<manifest name>/<target>/<run id>/` holding `manifest.yaml` (resolved),
`env.json`, `result.json`, `log.txt` and `DONE`. Every file is written atomically (temp file in
the same directory, fsync, rename), and `DONE` is written last: a directory without it is an
incomplete run, which the next attempt clears and redoes. A run with `DONE` is skipped unless
forced. The runs root is `./runs`, or `$CARAMBA_RUNS_DIR`, or an explicit argument.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import caramba
from caramba.errors import RunError

DONE = "DONE"
LOG = "log.txt"


def runs_root(root: str | Path | None = None) -> Path:
    """The directory that holds all run records: `root`, else $CARAMBA_RUNS_DIR, else ./runs."""
    return Path(root or os.environ.get("CARAMBA_RUNS_DIR") or "runs")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:  # KeyboardInterrupt included: never leave the temp file behind
        Path(temp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # make the rename itself durable


def atomic_write_json(path: str | Path, obj: Any) -> None:
    # Serialise first, so an unserialisable object fails before any file is touched.
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunDir:
    """The record directory of one run."""

    def __init__(self, manifest_name: str, target: str, run_id: str, root: str | Path | None = None):
        for part in (manifest_name, target, run_id):
            # The manifest schema already insists on safe identifiers; this guards rmtree in begin().
            if not part or part in (".", "..") or "/" in part or "\\" in part:
                raise ValueError(f"{part!r} cannot name a run directory")
        self.path = runs_root(root) / manifest_name / target / run_id

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def is_done(self) -> bool:
        """True when a previous attempt finished; the runner skips such runs unless forced."""
        return (self.path / DONE).is_file()

    def begin(self, force: bool = False) -> None:
        """Start from an empty directory, clearing an incomplete previous attempt (or, with
        `force`, a complete one)."""
        if self.is_done() and not force:
            raise RunError(f"{self.path} already holds a finished run; use --force to redo it")
        # Drop DONE first so that a clear interrupted halfway never leaves a 'finished' husk.
        (self.path / DONE).unlink(missing_ok=True)
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)

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

    def discard(self) -> None:
        """Remove this run's directory: its input turned out bad, so nothing of it is kept."""
        shutil.rmtree(self.path, ignore_errors=True)

    def finish(self) -> None:
        """Mark the run complete; call after every other file is written."""
        atomic_write_text(self.path / DONE, utc_now() + "\n")


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
