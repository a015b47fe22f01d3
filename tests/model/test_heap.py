"""caramba.model.heap: glibc keeps a forward's freed temporaries for reuse once keep_freed() ran,
and is left alone where it is switched off, tuned by the environment, or not glibc."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from caramba.model import heap

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# 64 blocks of 1 MiB touched, then all freed: glibc maps each block above its default 128 KiB
# threshold and unmaps it on free, so the resident set falls back; with keep_freed() they come from
# the heap and stay resident for the next forward. Run in a fresh interpreter: malloc's state is
# per process. No torch: the blocks are malloc's own.
_PROBE = """
import ctypes, os, sys
sys.path.insert(0, {root!r})
from caramba.model import heap
if {keep}:
    print(heap.keep_freed(), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
before = resident()
blocks = [libc.malloc(1 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
for b in blocks:
    libc.free(b)
print(resident() - before)
"""


def _kept_after_free(keep: bool, env: dict[str, str] | None = None) -> int:
    root = str(Path(heap.__file__).resolve().parents[2])   # the directory holding the caramba package
    out = subprocess.run([sys.executable, "-c", _PROBE.format(root=root, keep=keep)],
                         capture_output=True, text=True, check=True,
                         env={k: v for k, v in (env or os.environ).items()   # glibc's defaults, glibc's malloc
                              if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")})
    return int(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_freed_blocks_stay_for_reuse_only_with_keep_freed():
    kept = _kept_after_free(True, {**os.environ, heap.ENV: "1"})
    returned = _kept_after_free(False)
    assert kept >= 48 << 20, f"keep_freed: only {kept >> 20} MiB of the 64 freed stayed resident"
    assert returned <= 16 << 20, f"glibc's defaults kept {returned >> 20} MiB (expected them unmapped)"


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_switched_off_it_leaves_malloc_alone():
    assert _kept_after_free(True, {**os.environ, heap.ENV: "0"}) <= 16 << 20


@pytest.fixture
def fresh(monkeypatch):
    """keep_freed() deciding anew, with mallopt recorded instead of called."""
    calls = []
    monkeypatch.setattr(heap, "_status", None)
    monkeypatch.setattr(heap, "_mallopt", lambda param, value: calls.append((param, value)) or 1)
    for name in (*heap._TUNED_BY, "GLIBC_TUNABLES", "LD_PRELOAD", heap.ENV):
        monkeypatch.delenv(name, raising=False)
    return calls


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_keep_freed_sets_both_thresholds_once(fresh):
    assert heap.status() == "not set"
    first = heap.keep_freed()
    assert first == heap.keep_freed() == heap.status() == "glibc: mmap threshold 32 MiB, trim threshold 512 MiB"
    assert fresh == [(heap.M_MMAP_THRESHOLD, 32 << 20), (heap.M_TRIM_THRESHOLD, 512 << 20)]


@pytest.mark.parametrize("name, value, said", [
    (heap.ENV, "0", "off (CARAMBA_HEAP=0)"),
    ("MALLOC_TRIM_THRESHOLD_", "1000000", "left alone (the environment sets MALLOC_TRIM_THRESHOLD_)"),
    ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096", "left alone (the environment sets GLIBC_TUNABLES)"),
    ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2", "left alone (another allocator is preloaded)"),
])
def test_what_it_leaves_alone_and_says(fresh, monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    if GLIBC or name == heap.ENV:
        assert heap.keep_freed() == said
    assert fresh == []


def test_off_glibc_it_does_nothing(fresh, monkeypatch):
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("", ""))
    assert heap.keep_freed() == "left alone (not glibc)" and fresh == []


def test_a_refused_threshold_is_said(fresh, monkeypatch):
    if not GLIBC:
        pytest.skip("glibc's mallopt")
    monkeypatch.setattr(heap, "_mallopt", lambda param, value: 0)
    assert heap.keep_freed() == "left alone (mallopt refused the thresholds)"
