"""Small C kernels, loaded with ctypes: prebuilt at install time, else built here on first use.

An installed caramba (`pip install .`, or a wheel) carries each library prebuilt in every
instruction-set variant (caramba/kernel_build.py: the list of libraries and variants; setup.py
builds them into caramba/_kernels), and `load` takes the highest variant this CPU can run whose
source hash matches the sources beside it: no compiler needed at run time. A source tree used in
place (an editable install), a stale prebuilt library, or a test build with its own flags compiles
at run time instead with the system C compiler and -march=native (saying so once on stderr first,
with a spinner on a terminal), cached under $CARAMBA_CACHE_DIR/kernels (default
~/.cache/caramba/kernels), keyed by its source, the compile command and this CPU's flags
(-march=native code is only good on the CPU it was built for); the file appears atomically, so a
concurrent build or reader never sees half a library.

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
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from caramba import kernel_build

# the run-time build's command: kernel_build's shared flags with -march=native
FLAGS = [*kernel_build.COMMON_FLAGS[:1], "-march=native", *kernel_build.COMMON_FLAGS[1:]]
LIBS = kernel_build.LIBS


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line (x86-64), else the features kernel_build reads (macOS's sysctl,
    AArch64's Features), else the processor's name: part of a run-time build's key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    features = kernel_build.cpu_features()
    return "features " + " ".join(sorted(features)) if features else platform.processor()


def kernel_dir() -> Path:
    return Path(os.environ.get("CARAMBA_CACHE_DIR", Path.home() / ".cache" / "caramba")) / "kernels"


# library name -> where its loaded copy came from: "prebuilt <variant>" or "built here" (for records
# and tests; the status strings stay 'c')
origin: dict[str, str] = {}
# library name -> the loaded file's name (a library built here is named by the hash of its sources,
# command and CPU), for records
files: dict[str, str] = {}
# library name -> the sha256 of the loaded file's bytes: which machine code computes, for the keys of
# kept results (caramba.model.backend.arithmetic). A comment edited in a source renames a build here
# but compiles to the same bytes, so results kept before stay valid; another compiler's do not.
digests: dict[str, str] = {}


def prebuilt_dir() -> Path:
    return kernel_build.PACKAGE / kernel_build.PREBUILT_DIR


def prebuilt(source: Path | list[Path], cpu: set[str] | None = None,
             directory: Path | None = None) -> tuple[Path, str] | None:
    """(path, variant name) of the best prebuilt library for `source` that this CPU (its
    /proc/cpuinfo flags, or `cpu`) can run and whose source hash matches the sources as they are
    now; None when there is none (a source tree used in place, or stale: the sources changed)."""
    sources = _sources(source)
    directory = directory or prebuilt_dir()
    if not directory.is_dir():
        return None
    name, digest = sources[0].stem, kernel_build.source_hash(sources)
    found = {}
    for path in directory.glob(f"{name}-*-{digest}.so"):
        found[path.name[len(name) + 1:-len(f"-{digest}.so")]] = path
    cpu = kernel_build.cpu_features() if cpu is None else cpu
    variant = kernel_build.choose(cpu, list(found))
    return (found[variant.name], variant.name) if variant else None


def _announce_build(sources: list[Path]):
    """Says, before a run-time compile, that it is happening and roughly how long it takes: a rich
    spinner (transient) on a terminal, a plain line otherwise. A context manager."""
    import contextlib

    seconds = 5 + 8 * len(sources)   # about 8 s a file on one core of a 2-core Xeon, -O3
    text = f"caramba: building caramba's C kernels for this CPU, once: ~{seconds} s ({sources[0].stem})"
    if sys.stderr.isatty():
        try:
            from rich.console import Console

            return Console(stderr=True).status(text, spinner="dots")
        except Exception:   # rich missing or broken: the plain line below
            pass
    print(text, file=sys.stderr, flush=True)
    return contextlib.nullcontext()


def _sources(source: Path | list[Path]) -> list[Path]:
    return [source] if isinstance(source, Path) else list(source)


def build(source: Path | list[Path], cc: str, flags: list[str] = FLAGS) -> Path:
    """The shared library of `source` (one C file, or several compiled together: the first names
    it), compiled once per (sources, command, CPU) and cached."""
    sources = _sources(source)
    command = [cc, *flags, *LIBS]
    key = hashlib.sha256(b"".join(kernel_build.source_bytes(s) for s in sources) + " ".join(command).encode()
                         + cpu_flags().encode() + platform.machine().encode()).hexdigest()[:16]
    out_dir = kernel_dir()
    out = out_dir / f"{sources[0].stem}-{key}.so"
    if not out.exists():
        with _announce_build(sources):
            _compile(cc, flags, sources, out_dir, out)
    return out


def _compile(cc: str, flags: list[str], sources: list[Path], out_dir: Path, out: Path) -> None:
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


def load(source: Path | list[Path], signatures: dict[str, tuple[list, object]], purpose: str,
         flags: list[str] = FLAGS) -> tuple[ctypes.CDLL | None, str]:
    """(library, status): the built and loaded `source` (a C file, or several linked together) with `signatures` (function name ->
    (argtypes, restype)) set, status 'c'; or (None, why not) after one stderr line
    "caramba: warning: <purpose> through the slower eager path: kernels <why>". Callers cache the
    result (Library), so the line comes once per library and process."""
    if os.environ.get("CARAMBA_KERNELS", "1") == "0":
        return None, "off (CARAMBA_KERNELS=0)"
    if flags == FLAGS:   # prebuilt only for the default flags: a test's -D build compiles here
        found = prebuilt(source)
        if found:
            try:
                lib = _bind(ctypes.CDLL(str(found[0])), signatures)
                _loaded(source, f"prebuilt {found[1]}", found[0])
                return lib, "c"
            except (OSError, AttributeError) as e:   # e.g. a missing libgomp: compile here instead
                print(f"caramba: warning: prebuilt {found[0].name} did not load ({e}); building here",
                      file=sys.stderr, flush=True)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        status = "unavailable: no C compiler (cc)"
    else:
        try:
            built = build(source, cc, flags)
            lib = _bind(ctypes.CDLL(str(built)), signatures)
            _loaded(source, "built here", built)
            return lib, "c"
        except (OSError, AttributeError, subprocess.SubprocessError) as e:
            status = f"unavailable: build failed ({_reason(e)})"
    print(f"caramba: warning: {purpose} through the slower eager path: kernels {status}", file=sys.stderr, flush=True)
    return None, status


def _loaded(source: Path | list[Path], where: str, path: Path) -> None:
    name = _sources(source)[0].stem
    origin[name], files[name] = where, path.name
    digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _bind(lib: ctypes.CDLL, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


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
