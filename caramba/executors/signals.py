"""SIGTERM and SIGHUP end `caramba run` the way Ctrl-C does.

A batch system's kill (SIGTERM), a closed terminal or ssh session (SIGHUP) and Ctrl-C (SIGINT)
all mean "stop": each becomes a KeyboardInterrupt in the main thread, so a serial run abandons its
record (no DONE) and a sweep's driver cancels its executor (pool workers stopped, Ray tasks
cancelled, Slurm jobs named with the scancel command) and prints its summary. The exit code
follows the shell's rule, 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt raised by SIGTERM or SIGHUP; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


def stop_once(signum: int, frame) -> None:
    """A pool worker's handler for every stop signal: the first ends the run (KeyboardInterrupt for
    SIGINT, else Interrupted); the rest are ignored from then on. Ctrl-C reaches the whole process
    group and the driver's cancel() sends one more SIGINT: arriving while the run's record was
    still logging `interrupted` and moving the attempt into place, that second one cut the
    cleanup short (a record left without its log)."""
    for each in (signal.SIGINT, *SIGNALS):
        signal.signal(each, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signum)


@contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise Interrupted in the main thread (no-op elsewhere:
    Python lets only the main thread set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, raise_interrupted) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def exit_code(error: KeyboardInterrupt) -> int:
    return 128 + getattr(error, "signum", signal.SIGINT)
