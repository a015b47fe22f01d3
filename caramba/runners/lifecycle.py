"""One run's lifecycle, the same for every way a run is done: a manifest's runs in this process
(caramba.runners.run_manifest), an executor's worker (caramba.runners.execute: the local pool,
Ray, Slurm) and the command line's one-off records (`caramba bench`); the commands that print
their result instead of keeping it (`caramba generate`, `caramba eval`) run it on a Transient.

    lock -> partial dir -> (the run writes its files) -> DONE -> atomic swap -> release

`locked` holds the run's lock (caramba.runs.RunDir) for a block; `Attempt` builds one record
aside and swaps it in only when complete, so a crash, a failure or Ctrl-C never costs a finished
record and never leaves a half-written one where records are read. What each failure leaves is
decided here, once: bad input found late (UserError) leaves nothing; an interrupt or a failure
leaves the attempt's log (`interrupted`, or the traceback and `FAILED: ...`) without DONE.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from caramba.errors import RunError, UserError
from caramba.runs import RecordError, RunDir


@contextmanager
def locked(record: RunDir) -> Iterator[bool]:
    """The run's lock for the block: yields False (the caller does nothing) when another process
    holds it; released on the way out, whatever happens. RecordError when the lock path is not a
    lock file."""
    try:
        yield record.try_lock()
    finally:
        record.release()


class Attempt:
    """One attempt at a record, under its lock. Entering it begins the record (built aside in
    `.<id>.partial`; a finished record stays in place); the `with` block writes the record's
    files through `record.path`; leaving the block normally finishes it (DONE with its files'
    digests, then swapped in). The record is begun in `__enter__`, not on creation, so that no
    statement lies between the attempt's directory and the block that abandons it: a Ctrl-C
    landing there left the directory without its `interrupted` log.

    Leaving it by an exception, which always propagates: a UserError discards the attempt; an
    interrupt (Ctrl-C, SIGTERM, SystemExit) logs `interrupted` and abandons it; any other failure
    logs its traceback (a RunError's message says enough) and `FAILED: <message>`, and abandons
    it. `message` is then the failure as a line (with a note when the log could not be written),
    `where` the directory that holds the attempt's files. `begun` is False while the record
    could not be begun (begin's RecordError is the caller's to report: no attempt, no log)."""

    def __init__(self, record: RunDir):
        self.record = record
        self.message = ""
        self.begun = False
        self.where: Path = record.path

    def __enter__(self) -> Attempt:
        try:
            self.record.begin(force=True)
        except (KeyboardInterrupt, SystemExit) as e:   # after the attempt's directory was made
            if self.record.path == self.record.staging and self.record.staging.is_dir():
                self._failed(e, e.__traceback__)
            raise
        self.begun = True
        self.where = self.record.path
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None:
            try:
                self.record.finish()
            except BaseException as e:   # DONE or the swap refused (a full or read-only disk): a failure
                self._failed(e, e.__traceback__)
                raise
            self.where = self.record.final
            return False
        self._failed(error, tb)
        return False

    def _failed(self, error: BaseException, tb) -> None:
        if isinstance(error, UserError):   # bad input found late: leave nothing half-written
            self.record.discard()
            return
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            _try_log(self.record, "interrupted")
        else:
            if not isinstance(error, RunError):
                _try_log(self.record, "".join(traceback.format_exception(type(error), error, tb)))
            self.message = str(error) if isinstance(error, RunError) else f"{type(error).__name__}: {error}"
            try:
                self.record.log(f"FAILED: {self.message}")
            except RecordError as e:   # the disk that failed the run may refuse the log too: say so
                self.message += f" ({e})"
        self.where = self.record.abandon()


def _try_log(record: RunDir, text: str) -> None:
    try:
        record.log(text)
    except RecordError:   # a full or read-only disk: the failure is reported without its log
        pass


def one_off(manifest_name: str, target: str, stem: str, write: Callable[[RunDir], None]) -> RunDir:
    """A record outside any manifest (`caramba bench`): a fresh name under
    runs/<manifest_name>/<target>/ (`stem`, or `stem-2`, ... when taken), claimed by its lock,
    built by `write(record)` through an Attempt, released. Returns the record."""
    record = RunDir.unique(manifest_name, target, stem)
    with locked(record):
        with Attempt(record):
            write(record)
    return record


class Transient:
    """A run record that keeps nothing: what a runner writes through for `caramba generate` and
    `caramba eval`, which print their result instead (runners skip their extra files when `path`
    is None)."""

    path = None

    def log(self, message: str) -> None:
        pass
