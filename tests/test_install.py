"""caramba installed the way users install it (issue 47): a wheel built from the tree carries every
C source and header its kernels need (before, the headers were left out, every build failed and
caramba ran its torch path 35x slower at q8_0 decode) and its kernels prebuilt per instruction-set
variant (setup.py, caramba/kernel_build.py); the installed copy, imported from outside the checkout
with no C compiler anywhere, loads the prebuilt libraries for this CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tree_copy(dest: Path) -> Path:
    """The files a clone of the working tree has (tracked and new, not ignored): building in a copy
    leaves no build/ or egg-info behind in the checkout."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _build_wheel(tree: Path, out: Path, variants: str, **env: str) -> Path:
    """A wheel built with pip and this venv's setuptools (no build isolation: no download, so it
    works offline); variants: CARAMBA_KERNEL_VARIANTS, the kernel variants setup.py builds; env:
    more of setup.py's environment (a cross build's CARAMBA_KERNEL_ARCH and CC)."""
    env = {**os.environ, "CARAMBA_KERNEL_VARIANTS": variants, **env}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                           "--wheel-dir", str(out), str(tree)], capture_output=True, text=True, timeout=1800,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (found,) = out.glob("caramba-*.whl")
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel with no kernels prebuilt (CARAMBA_KERNEL_VARIANTS=none): seconds, for its file list."""
    return _build_wheel(_tree_copy(tmp_path_factory.mktemp("tree")), tmp_path_factory.mktemp("wheel"), "none")


def _cpu() -> set[str]:
    from caramba import kernel_build

    return kernel_build.cpu_features()


def _variants_here() -> list[str]:
    """The baseline variant and the best this CPU runs: two of them, so the test sees the choice
    (every variant would take several times as long on CI's 2 cores)."""
    from caramba import kernel_build

    best = kernel_build.choose(_cpu(), [v.name for v in kernel_build.variants()])
    if best is None:
        pytest.skip(f"no kernel variants for {kernel_build.machine()}")
    return list(dict.fromkeys([kernel_build.variants()[0].name, best.name]))


@pytest.fixture(scope="module")
def wheel_with_kernels(tmp_path_factory) -> Path:
    return _build_wheel(_tree_copy(tmp_path_factory.mktemp("tree")), tmp_path_factory.mktemp("wheelk"),
                        ",".join(_variants_here()))


def test_the_wheel_carries_every_file_its_kernels_include(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        c_files = sorted(n for n in names if n.endswith((".c", ".h")))
        assert "caramba/cache/kinds.h" in names and "caramba/model/amx_emulate.h" in names, c_files
        for name in c_files:
            for included in re.findall(r'^\s*#\s*include\s+"([^"]+)"', z.read(name).decode(), re.M):
                path = os.path.normpath(os.path.join(os.path.dirname(name), included))
                assert path in names, f"{name} includes {included}, which the wheel lacks"
    # every library's sources, as its module lists them, are in the wheel
    from caramba.cache import kernel
    from caramba import fused
    from caramba.model import fast_decode, quant, quant_gemm

    for source in [kernel.SOURCE, fused.SOURCE, *quant.SOURCES, *fast_decode.SOURCES, *quant_gemm.SOURCES]:
        assert source.relative_to(ROOT).as_posix() in names


CHECK = """
import json, caramba
from caramba import kernels
from caramba.runs import kernel_status
from caramba.model import isa
print(json.dumps({"file": caramba.__file__, "kernels": kernel_status(), "isa": isa.kernel_isa(),
                  "origin": kernels.origin}))
"""


def test_a_wheel_with_no_kernels_is_still_platform_tagged(wheel):
    assert re.fullmatch(r"caramba-[^-]+-py3-none-(linux|macosx|win)_\w+\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")]


def test_a_cross_built_wheel_is_tagged_for_its_target(tmp_path):
    """CARAMBA_KERNEL_ARCH=aarch64 with the cross compiler: the wheel is linux_aarch64, not this
    machine's platform (its kernels: tests/model/test_cross_arm.py builds and runs each variant)."""
    import cross_arch

    if shutil.which(cross_arch.CC) is None:
        pytest.skip(f"no {cross_arch.CC} (apt install gcc-aarch64-linux-gnu)")
    wheel = _build_wheel(_tree_copy(tmp_path / "tree"), tmp_path / "wheel", "none", CARAMBA_KERNEL_ARCH="aarch64",
                         CC=cross_arch.CC)
    assert re.fullmatch(r"caramba-[^-]+-py3-none-linux_aarch64\.whl", wheel.name), wheel.name


@pytest.mark.parametrize("case", ["no variants", "no CC", "CC for this machine"])
def test_a_cross_build_setup_py_cannot_do_is_refused(case):
    """No variants for the target, no CC, or a CC for another target (this machine's own cc): exit 1
    with the reason, before anything builds (setup.py runs its check on load)."""
    from caramba import kernel_build

    other = next(arch for arch in kernel_build.VARIANTS if arch != kernel_build.machine())
    arch, cc, says = {"no variants": ("riscv64", "cc", "has no variants"), "no CC": (other, "", "set CC"),
                      "CC for this machine": (other, "cc", f"compiles for {kernel_build.machine()}")}[case]
    if cc and shutil.which(cc) is None:
        pytest.skip(f"no {cc}")
    env = {**os.environ, "CARAMBA_KERNEL_ARCH": arch, "CC": cc}
    done = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "caramba: cannot cross-build" in done.stderr and says in done.stderr, done.stderr


@pytest.mark.integration   # builds 5 C libraries x 2 variants at wheel build: minutes on 2 cores
def test_the_installed_wheel_loads_its_prebuilt_kernels_with_no_compiler(wheel_with_kernels, tmp_path):
    """The wheel is platform-tagged and carries every library in each variant built, named by the
    hash of the sources it ships; installed with pip (non-editable, --no-deps: torch and the rest
    come from this venv) into a directory, run from outside the checkout with no C compiler (CC
    points nowhere, PATH has no cc) so the installed copy is the one imported and nothing compiles."""
    from caramba import kernel_build

    wheel, variants = wheel_with_kernels, _variants_here()
    assert re.fullmatch(r"caramba-[^-]+-py3-none-linux_\w+\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/WHEEL")]
        assert "Root-Is-Purelib: false" in z.read(meta).decode()
    expected = {f"caramba/_kernels/{kernel_build.prebuilt_name(lib, v, kernel_build.source_hash(kernel_build.sources(lib)))}"
                for lib in kernel_build.LIBRARIES for v in variants}
    assert expected == {n for n in names if n.endswith(".so")}, sorted(names)

    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    no_cc = tmp_path / "bin"
    no_cc.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "CARAMBA_CACHE_DIR": str(tmp_path / "cache"),
           "CC": "/nonexistent/cc", "PATH": str(no_cc)}
    env.pop("CARAMBA_KERNELS", None)
    env.pop("CARAMBA_ISA", None)
    work = tmp_path / "elsewhere"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert Path(got["file"]).resolve().is_relative_to(target.resolve()), got["file"]
    assert got["kernels"] == dict.fromkeys(got["kernels"], "c"), got["kernels"]
    assert got["kernels"]["decode_step"] == "c"
    assert got["origin"] == dict.fromkeys(kernel_build.LIBRARIES, f"prebuilt {variants[-1]}"), got["origin"]
    assert not got["isa"].startswith("eager") and "caramba:" not in done.stderr, done.stderr
    assert not list((tmp_path / "cache").glob("**/*.so"))   # nothing compiled at run time
