"""glibc's malloc told to keep freed memory for the next forward instead of handing it back.

A prefill forward allocates and frees megabytes of temporaries per layer: the gate|up output
(SmolLM2, 8 rows x 512 tokens: 50 MB), the SiLU product, the attention's score and probability
blocks (1-6 MB each, a hundred a layer). glibc maps blocks above its mmap threshold afresh and
unmaps them on free, and trims the heap's free top above its trim threshold, so each forward
touched gigabytes of new pages: 370 thousand minor page faults in one 2048-token prefill of
SmolLM2, 1.7 million in a batch of 8 contexts of 1024 tokens (the eval's shared prefill), each a
kernel entry and a zeroed page. With the thresholds below the second prefill faults no page and
runs ~10-20% faster (AMD EPYC Zen 4, 2 threads: 8 x 1024 tokens in chunks of 512, 14.3-15.6 s ->
12.4-12.9 s in four processes of five; one 2048-token prefill 4.1-4.7 -> 3.5-4.0 s;
docs/decode-speed-log.md §27).

`keep_freed()` sets them once per process (mallopt: the same as MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ in the environment); caramba.model.zoo.load_model calls it for a CPU model.
A block above MMAP_THRESHOLD (a batch's KV cache) is still mapped and returned to the system when
freed; the heap keeps up to TRIM_THRESHOLD of free memory at its top, memory the process has
already used once. It leaves malloc alone where the process's environment tunes it already,
where another allocator is preloaded, and off glibc. `CARAMBA_HEAP=0` turns it off (the A/B
switch); `status()` says what was done, for records.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "CARAMBA_HEAP"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20    # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
# 64 MiB still faulted ~1.4 million pages a batch-8 prefill; 256 MiB none; twice that for margin
TRIM_THRESHOLD = 512 << 20
# Where the process's environment already tunes malloc, or another allocator is preloaded
_TUNED_BY = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_status: str | None = None


def _why_not() -> str | None:
    """Why malloc is left alone here, or None."""
    if os.environ.get(ENV, "1") == "0":
        return f"off ({ENV}=0)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "left alone (not glibc)"
    tuned = [name for name in _TUNED_BY if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        tuned.append("GLIBC_TUNABLES")
    if tuned:
        return f"left alone (the environment sets {', '.join(tuned)})"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return "left alone (another allocator is preloaded)"
    return None


def _mallopt(param: int, value: int) -> int:
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(param, value)


def keep_freed() -> str:
    """Set glibc's mmap and trim thresholds once (see the module doc); returns status()."""
    global _status
    if _status is None:
        _status = _why_not()
        if _status is None:
            if _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
                _status = f"glibc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
            else:
                _status = "left alone (mallopt refused the thresholds)"
    return _status


def status() -> str:
    """What keep_freed() did in this process ("not set" before it ran)."""
    return _status or "not set"
