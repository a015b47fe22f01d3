"""Small C kernels built on first use with the system C compiler and loaded with ctypes.

No build step at install and no torch headers, so a build takes about a second. Each library is
cached under $CARAMBA_CACHE_DIR/kernels (default ~/.cache/caramba/kernels), keyed by its source,
the compile command and this CPU's flags (-march=native code is only good on the CPU it was built
for); the file appears atomically, so a concurrent build or reader never sees half a library.

Callers keep an eager path for when a library is unavailable: CARAMBA_KERNELS=0, no C compiler,
or a failed build (one line on stderr says why, once per library: never silent, and not a Python
warning that a filter could swallow); each user's `status()` says which, for records. Used by caramba.cache.kernel (quant_attend.c), caramba.model.quant
(quant_gemv.c + cpu_isa.c) and caramba.model.fast_decode (decode_step.c and the files it calls).
A library of several files is one compiler command over all of them; each shares what the others
need through its header (x.c declares its shared functions in x.h), never by #including a .c.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# after the sources: the kernels call libm (lrintf, expf), which x86-64 inlines and aarch64 does
# not; inside Python libm happens to be loaded already, but a library must name what it needs
LIBS = ["-lm"]


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def kernel_dir() -> Path:
    return Path(os.environ.get("CARAMBA_CACHE_DIR", Path.home() / ".cache" / "caramba")) / "kernels"


def _source_bytes(source: Path, seen: frozenset = frozenset()) -> bytes:
    """The source and, recursively, the files it #includes "like_this.h" (paths relative to it): a
    library is rebuilt when any of them changes."""
    text = source.read_bytes()
    parts = [text]
    for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', text, re.M):
        included = (source.parent / name.decode()).resolve()
        if included.exists() and included not in seen:
            parts.append(_source_bytes(included, seen | {source.resolve()}))
    return b"".join(parts)


def _sources(source: Path | list[Path]) -> list[Path]:
    return [source] if isinstance(source, Path) else list(source)


def build(source: Path | list[Path], cc: str, flags: list[str] = FLAGS) -> Path:
    """The shared library of `source` (one C file, or several compiled together: the first names
    it), compiled once per (sources, command, CPU) and cached."""
    sources = _sources(source)
    command = [cc, *flags, *LIBS]
    key = hashlib.sha256(b"".join(_source_bytes(s) for s in sources) + " ".join(command).encode()
                         + cpu_flags().encode() + platform.machine().encode()).hexdigest()[:16]
    out_dir = kernel_dir()
    out = out_dir / f"{sources[0].stem}-{key}.so"
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, *map(str, sources), *LIBS, "-o", tmp], check=True, capture_output=True, text=True,
                           timeout=600)   # a build took 130 s at load average 12
            os.replace(tmp, out)   # atomic: a concurrent build or reader never sees half a library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def load(source: Path | list[Path], signatures: dict[str, tuple[list, object]], purpose: str,
         flags: list[str] = FLAGS) -> tuple[ctypes.CDLL | None, str]:
    """(library, status): the built and loaded `source` (a C file, or several linked together) with `signatures` (function name ->
    (argtypes, restype)) set, status 'c'; or (None, why not) after one stderr line
    "caramba: warning: <purpose> through the slower eager path: kernels <why>". Callers cache the
    result (Library), so the line comes once per library and process."""
    if os.environ.get("CARAMBA_KERNELS", "1") == "0":
        return None, "off (CARAMBA_KERNELS=0)"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        status = "unavailable: no C compiler (cc)"
    else:
        try:
            lib = ctypes.CDLL(str(build(source, cc, flags)))
            for name, (argtypes, restype) in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
            return lib, "c"
        except (OSError, AttributeError, subprocess.SubprocessError) as e:
            status = f"unavailable: build failed ({_reason(e)})"
    print(f"caramba: warning: {purpose} through the slower eager path: kernels {status}", file=sys.stderr, flush=True)
    return None, status


def _reason(e: Exception) -> str:
    """Why a build or load failed, in a line: the compiler's first error (gcc's last line,
    "compilation terminated.", names nothing), else how it exited, else the exception."""
    stderr = getattr(e, "stderr", None) or ""
    stderr = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr   # a timeout's may be bytes
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    if errors or lines:
        return (errors or lines)[0]
    if isinstance(e, subprocess.CalledProcessError):
        return f"{Path(e.cmd[0]).name} exited with status {e.returncode}"
    return str(e)


class Library:
    """One C library's kernels (one source file, or several compiled together; `flags`: the compile
    command's, a test build's -D added) for its callers: `library()` builds and loads them on first use and
    then returns the same handle (or None, after one stderr line); `status()` says which ('c' or why
    not); `cache_clear()` forgets, so the next call loads again (tests, a changed environment)."""

    def __init__(self, source: Path | list[Path], signatures: dict[str, tuple[list, object]], purpose: str,
                 flags: list[str] = FLAGS) -> None:
        self.source, self.signatures, self.purpose, self.flags = source, signatures, purpose, flags
        self.cache_clear()

    def __call__(self) -> ctypes.CDLL | None:
        if not self._loaded:
            self._lib, self._status = load(self.source, self.signatures, self.purpose, self.flags)
            self._loaded = True
        return self._lib

    def status(self) -> str:
        self()
        return self._status

    def cache_clear(self) -> None:
        self._lib, self._status, self._loaded = None, "not built yet", False
