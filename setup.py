"""Builds caramba's C kernels when the package is installed (issue 47).

setuptools (pyproject.toml's build backend), not scikit-build-core or meson-python: the kernels are
plain C shared libraries loaded with ctypes (not Python extension modules), each one `cc` command
over a few files, so there is nothing for CMake or meson to configure. build_py compiles every
library (caramba/kernel_build.py: LIBRARIES) in every instruction-set variant of this machine's
architecture (VARIANTS: x86-64-v2 .. AMX, or ARMv8 .. ARMv8.2+dotprod) into the build's
caramba/_kernels, in parallel, and caramba.kernels loads the best one the running CPU supports.

- The wheel is platform-tagged (the .so files are machine code): BinaryDistribution.
- No C compiler, or a variant the compiler cannot build: a warning, the install goes on, and
  caramba compiles at run time (caramba.kernels' fallback), as before.
- An editable install (`pip install -e .`, `make setup`) builds nothing: a tree used in place
  compiles at run time with -march=native (the best code for the CPU in front of you, rebuilt
  whenever a source changes) and says so on stderr first.
- CARAMBA_KERNEL_VARIANTS=name,name (e.g. "avx2,avx512") builds only those variants (tests, a
  quick local wheel); CARAMBA_KERNEL_VARIANTS=none builds none.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel   # setuptools >= 70.1
except ImportError:   # older setuptools: the wheel package's, else none (the tag stays cpXY-cpXY-<platform>)
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

HERE = Path(__file__).resolve().parent


def _kernel_build():
    """caramba/kernel_build.py by path: importing caramba would import torch, absent at build time."""
    spec = importlib.util.spec_from_file_location("caramba_kernel_build", HERE / "caramba" / "kernel_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses looks its module up
    spec.loader.exec_module(module)
    return module


def _say(line: str) -> None:
    print(f"caramba: {line}", file=sys.stderr, flush=True)   # pip shows it with -v


class BuildKernels(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            _say("editable install: C kernels are built at run time, on first use")
            return
        self.build_kernels(Path(self.build_lib) / "caramba" / "_kernels")

    def build_kernels(self, out_dir: Path) -> None:
        kb = _kernel_build()
        wanted = os.environ.get("CARAMBA_KERNEL_VARIANTS", "").strip()
        variants = kb.variants()
        if wanted:
            variants = [v for v in variants if v.name in wanted.split(",")]
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not variants:
            _say(f"no C kernel variants to build for {kb.machine()} (CARAMBA_KERNEL_VARIANTS={wanted!r}): "
                 "caramba compiles them at run time")
            return
        if not cc:
            _say("warning: no C compiler (cc): C kernels not prebuilt; caramba compiles them at run time if it can")
            return
        package = HERE / "caramba"
        unique = sorted({s for name in kb.LIBRARIES for s in kb.sources(name, package)},
                        key=lambda s: -s.stat().st_size)   # the longest first: the pool stays busy to the end
        _say(f"building {len(kb.LIBRARIES)} C kernel libraries ({len(unique)} source files) x {len(variants)} "
             f"variants ({', '.join(v.name for v in variants)}) with {cc}, {os.cpu_count()} jobs")
        start = time.monotonic()
        obj_dir = Path(tempfile.mkdtemp(prefix="caramba-kernels-"))

        def failed(what: str, e: Exception) -> str:
            err = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
            return f"warning: {what} not built: {err[0] if err else e}"

        def compile_one(job):
            source, v = job
            try:
                return kb.compile_object(cc, source, v, obj_dir, package), None
            except (OSError, subprocess.SubprocessError) as e:
                return None, failed(f"{source.name} [{v.name}]", e)

        def link_one(job):
            name, v = job
            objects = [objs.get((s, v.name)) for s in kb.sources(name, package)]
            if any(o is None for o in objects):
                return f"warning: {name} [{v.name}] not built: a source of it did not compile"
            try:
                kb.link_variant(cc, name, v, objects, out_dir, package)
                return f"built {name} [{v.name}]"
            except (OSError, subprocess.SubprocessError) as e:
                return failed(f"{name} [{v.name}]", e)

        try:
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                jobs = [(s, v) for v in variants for s in unique]
                objs = {}
                for (source, v), (obj, warning) in zip(jobs, pool.map(compile_one, jobs)):
                    if warning:
                        _say(warning)
                    objs[(source, v.name)] = obj
                _say(f"compiled {sum(o is not None for o in objs.values())} objects in {time.monotonic() - start:.0f} s")
                for line in pool.map(link_one, [(name, v) for name in kb.LIBRARIES for v in variants]):
                    _say(line)
        finally:
            shutil.rmtree(obj_dir, ignore_errors=True)
        _say(f"C kernels built in {time.monotonic() - start:.0f} s")


class BinaryDistribution(Distribution):
    """A platform wheel: it carries machine code (caramba/_kernels/*.so)."""

    def has_ext_modules(self) -> bool:
        return True


cmdclass = {"build_py": BuildKernels}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """py3-none-<platform>: the libraries are plain C loaded with ctypes, not tied to a Python ABI."""

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
