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
- Cross build: CARAMBA_KERNEL_ARCH=<arch> with CC a cross compiler for it builds that architecture's
  variants instead, and tags the wheel linux_<arch> (Linux only), e.g. an ARM64 wheel on x86-64:
      CARAMBA_KERNEL_ARCH=aarch64 CC=aarch64-linux-gnu-gcc pip wheel . --no-deps --no-build-isolation -w dist
  An architecture with no variants, no CC, or a CC whose `-dumpmachine` names another target is
  refused (exit 1) before anything builds: a wheel tagged for one CPU with another's code would
  install and then fail on every call.
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


def _target_arch(kb) -> str:
    """The architecture the kernels are built for: this machine's, else CARAMBA_KERNEL_ARCH's (a
    cross build: CC must be a Linux cross compiler for it); exits with the reason where it cannot be."""
    arch = os.environ.get("CARAMBA_KERNEL_ARCH", "").strip() or kb.machine()
    if arch == kb.machine():
        return arch

    def refuse(why: str):
        raise SystemExit(f"caramba: cannot cross-build for CARAMBA_KERNEL_ARCH={arch}: {why}")

    if not kb.variants(arch):
        refuse(f"caramba/kernel_build.py has no variants for it (only for {', '.join(kb.VARIANTS)})")
    if not sys.platform.startswith("linux"):
        refuse("cross builds are Linux only (the wheel is tagged linux_<arch>)")
    cc = os.environ.get("CC")
    if not cc:
        refuse(f"set CC to a cross compiler for it (e.g. CC={arch}-linux-gnu-gcc)")
    try:   # the compiler's target triple, e.g. aarch64-linux-gnu: cheap, and catches CC=gcc
        target = subprocess.run([cc, "-dumpmachine"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        refuse(f"CC={cc} does not run: {e}")
    if target.split("-")[0] != arch or "linux" not in target:
        refuse(f"CC={cc} compiles for {target or 'an unknown target'}, not {arch} Linux")
    return arch


KB = _kernel_build()
KERNEL_ARCH = _target_arch(KB)   # checked first: a refused cross build fails before anything builds


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
        kb = KB
        # a previous build's libraries (another architecture, other variants) must not ship in this wheel
        shutil.rmtree(out_dir, ignore_errors=True)
        wanted = os.environ.get("CARAMBA_KERNEL_VARIANTS", "").strip()
        variants = kb.variants(KERNEL_ARCH)
        if wanted:
            variants = [v for v in variants if v.name in wanted.split(",")]
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not variants:
            _say(f"no C kernel variants to build for {KERNEL_ARCH} (CARAMBA_KERNEL_VARIANTS={wanted!r}): "
                 "caramba compiles them at run time")
            return
        if not cc:
            _say("warning: no C compiler (cc): C kernels not prebuilt; caramba compiles them at run time if it can")
            return
        package = HERE / "caramba"
        unique = sorted({s for name in kb.LIBRARIES for s in kb.sources(name, package)},
                        key=lambda s: -s.stat().st_size)   # the longest first: the pool stays busy to the end
        _say(f"building {len(kb.LIBRARIES)} C kernel libraries ({len(unique)} source files) x {len(variants)} "
             f"{KERNEL_ARCH} variants ({', '.join(v.name for v in variants)}) with {cc}, {os.cpu_count()} jobs")
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
        """py3-none-<platform>: the libraries are plain C loaded with ctypes, not tied to a Python ABI;
        a cross build's platform is the target's (bdist_wheel's own --plat-name, unless given)."""

        def finalize_options(self):
            if KERNEL_ARCH != KB.machine() and not self.plat_name:
                self.plat_name = f"linux_{KERNEL_ARCH}"
            super().finalize_options()

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
