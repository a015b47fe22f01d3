"""Another process keeping one core busy: the contention that caramba.threads must see, for the
contention test and benchmarks/contention.py.

The child is a separate process (not a thread of ours, which the sampler would add back as our
own time), pinned to one CPU with os.sched_setaffinity, and spins until told to stop or until
its own deadline, so it never outlives a crashed parent by more than `seconds`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
"""


@contextmanager
def busy_core(cpu: int | None = None, seconds: float = 60.0):
    """A spinning process pinned to `cpu` (default: the last CPU this process may use) for at most
    `seconds`; yields the CPU. Stopped (killed and reaped) when the block ends."""
    if cpu is None:
        cpu = max(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu), str(seconds)], stdout=subprocess.PIPE,
                             text=True)
    try:
        if child.stdout.readline().strip() != "ready":    # pinned and about to spin
            raise RuntimeError(f"the busy process on CPU {cpu} did not start (exit code {child.poll()})")
        time.sleep(0.05)     # let it own the core for a scheduler slice or two before anyone samples
        yield cpu
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
