"""How many threads caramba's CPU work runs on: the cores actually free, unless the user says.

Every OpenMP barrier of the fused decode step (five per layer) and every parallel torch op waits
for its slowest thread. When another process holds one of the cores, the thread that shares that
core is descheduled for whole scheduler slices, and two threads ran slower than one by 6x
(docs/decode-speed.md, "Under contention"). So a generation samples, once when it starts, how
idle each CPU it may run on (os.sched_getaffinity) was over a short window, from /proc/stat, and
runs on as many threads as there are free cores, at most the count torch was given.

The order of precedence, first wins:
  1. CARAMBA_THREADS=N (a positive integer): exactly N threads, busy machine or not.
  2. torch.set_num_threads(n) / OMP_NUM_THREADS: the ceiling; fewer are used when fewer cores are
     free (CARAMBA_THREADS=auto, or unset).
  3. torch's default (the physical cores) as that ceiling.

`choose()` makes the choice (reusing one younger than REUSE_S, so a loop of short generations does
not sample every time); `applied()` sets torch's count to it for a block and restores it;
`record()` is the last choice as a dict for env.json. Linux only: elsewhere the ceiling is used,
and the record says why.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from caramba.errors import UserError

ENV = "CARAMBA_THREADS"
SAMPLE_S = 0.05      # the idle-time window: long enough for /proc/stat's 10 ms ticks to average
REUSE_S = 2.0        # a choice this young is reused
FREE_AT = 0.75       # free cores are the CPUs' idle fractions summed, rounded up from .75: a thread
                     # on a core another process keeps over a quarter busy still stalls barriers
SPINCOUNT = "1000"   # GOMP_SPINCOUNT caramba sets when the user set no wait policy (see bound_spinning)


@dataclass(frozen=True)
class Choice:
    asked: int                 # the ceiling: torch.get_num_threads() when chosen
    used: int                  # threads the work runs on
    source: str                # "CARAMBA_THREADS" | "free cores" | "one thread asked" | "no /proc/stat"
    why: str                   # one line for a reader
    free_cores: float | None = None    # sum of the CPUs' idle fractions (own process's time added back)
    cpus: tuple[int, ...] = ()         # the affinity the sample covered
    idle: tuple[float, ...] = ()       # each CPU's idle fraction over the window
    quota: float | None = None         # cgroup CPU quota in cores (cpu.max), when one is set
    at: float = 0.0                    # time.monotonic() of the choice

    def as_record(self) -> dict:
        out = asdict(self)
        out.pop("at")
        out["cpus"], out["idle"] = list(self.cpus), [round(v, 3) for v in self.idle]   # JSON-shaped
        out["free_cores"] = None if self.free_cores is None else round(self.free_cores, 3)
        return out


_last: Choice | None = None
_wait: dict = {}


class ThreadsError(UserError, ValueError):
    """A bad CARAMBA_THREADS: the CLI prints it and exits 2."""


def bound_spinning() -> dict:
    """Bound how long an OpenMP thread spins at a barrier before it sleeps: GOMP_SPINCOUNT=SPINCOUNT,
    unless the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY. libgomp reads it once, when it is
    loaded, and the C kernels share torch's libgomp (same soname, loaded by `import torch`), so
    this must run before torch is imported: caramba/__init__.py calls it. Returns (and keeps, for
    record()) what was done. A spinning waiter holds its core while the peer it waits for, pushed
    off its own core by another process, could have run there: with libgomp's default (300000
    spins, milliseconds) two threads decoded 0.13-0.15x as fast as one on a loaded 2-core machine,
    with 1000 (libgomp's own bound once it has more threads than CPUs) 0.94-1.4x
    (docs/decode-speed.md, "Under contention").
    """
    if _wait:
        return _wait
    mine = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ}
    if mine:
        _wait.update(mine, set_by="user")
    elif _libgomp_loaded():
        _wait.update(set_by="nobody: libgomp was loaded before caramba (import caramba before torch)")
    else:
        os.environ["GOMP_SPINCOUNT"] = SPINCOUNT
        _wait.update(GOMP_SPINCOUNT=SPINCOUNT, set_by="caramba")
    return _wait


def _libgomp_loaded() -> bool:
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def explicit() -> int | None:
    """CARAMBA_THREADS as a count; None when unset, empty or 'auto'."""
    raw = os.environ.get(ENV, "").strip()
    if raw.lower() in ("", "auto"):
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ThreadsError(f"{ENV} must be a positive integer or 'auto', got {raw!r}: "
                           f"set it to e.g. {ENV}=1, or unset it to use the free cores")
    return n


def _cpu_counters(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """cpu -> (idle ticks, total ticks) from /proc/stat. Steal time counts as busy (the
    hypervisor gave the core to someone else); iowait as idle."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        cpu = int(name[3:])
        if cpu in cpus:
            ticks = [int(v) for v in fields[:8]]   # user nice system idle iowait irq softirq steal
            out[cpu] = (ticks[3] + ticks[4], sum(ticks))
    return out


def cgroup_quota() -> float | None:
    """The cgroup v2 CPU quota in cores (cpu.max 'quota period'), or None when unlimited/unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def sample(window: float = SAMPLE_S) -> tuple[tuple[int, ...], tuple[float, ...], float]:
    """(cpus, idle fraction of each over `window`, free cores): free cores sums the idle fractions
    and adds back this process's own CPU time over the window (its OpenMP workers may still be
    spinning down from a previous step; they are not another process)."""
    cpus = set(os.sched_getaffinity(0))
    c0, own0, t0 = _cpu_counters(cpus), time.process_time(), time.monotonic()
    time.sleep(window)
    c1, own1, t1 = _cpu_counters(cpus), time.process_time(), time.monotonic()
    order = tuple(sorted(c1))
    idle = tuple(min(1.0, (c1[c][0] - c0[c][0]) / max(c1[c][1] - c0[c][1], 1)) for c in order)
    own = (own1 - own0) / max(t1 - t0, 1e-6)
    return order, idle, min(float(len(order)), sum(idle) + own)


def choose(max_age: float | None = None) -> Choice:
    """The thread count for the work about to start (see the module doc), remembered for record().
    A sampled choice younger than max_age (default REUSE_S) seconds, for the same ceiling, is reused."""
    global _last
    import torch

    max_age = REUSE_S if max_age is None else max_age
    asked = torch.get_num_threads()
    now = time.monotonic()
    pinned = explicit()
    if pinned is not None:
        choice = Choice(asked, pinned, ENV, f"{ENV}={pinned}", at=now)
    elif asked == 1:
        choice = Choice(1, 1, "one thread asked", "torch.get_num_threads() is 1", at=now)
    elif _last is not None and _last.source == "free cores" and _last.asked == asked and now - _last.at < max_age:
        return _last
    else:
        choice = _sampled(asked, now)
    _last = choice
    return choice


def _sampled(asked: int, now: float) -> Choice:
    try:
        cpus, idle, free = sample()
    except (OSError, ValueError, AttributeError) as e:      # not Linux, or no /proc
        return Choice(asked, asked, "no /proc/stat", f"could not sample idle time ({e}); torch's count", at=now)
    quota = cgroup_quota()
    cap = free if quota is None else min(free, quota)
    used = max(1, min(asked, math.floor(cap + (1 - FREE_AT))))
    why = (f"{free:.2f} of {len(cpus)} cores free over {SAMPLE_S * 1e3:.0f} ms"
           + (f", cgroup quota {quota:g}" if quota is not None else "") + f"; {used} of {asked} asked")
    return Choice(asked, used, "free cores", why, free, cpus, idle, quota, now)


def last() -> Choice | None:
    return _last


def record() -> dict:
    """The last choice as a dict (env.json's `threads`), choosing now when none was made, with
    the OpenMP wait policy in `wait`."""
    return {**(_last or choose()).as_record(), "wait": dict(bound_spinning())}


@contextmanager
def applied(choice: Choice):
    """torch's thread count (and so the C kernels', which read it) set to choice.used inside."""
    import torch

    before = torch.get_num_threads()
    if choice.used != before:
        torch.set_num_threads(choice.used)
    try:
        yield choice
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
