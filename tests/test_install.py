"""caramba installed the way users install it (issue 47): a wheel built from the tree carries every
C source and header its kernels need, and the installed copy, imported from outside the checkout,
builds and loads its C libraries in a fresh kernel cache (before, the headers were left out, every
build failed and caramba ran its torch path 35x slower at q8_0 decode)."""

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from the tree with pip and this venv's setuptools (no build isolation: no
    download, so it works offline)."""
    tree = _tree_copy(tmp_path_factory.mktemp("tree"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(out), str(tree)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = out.glob("caramba-*.whl")
    return found


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
    from caramba.model import fast_decode, fused, quant, quant_gemm

    for source in [kernel.SOURCE, fused.SOURCE, *quant.SOURCES, *fast_decode.SOURCES, *quant_gemm.SOURCES]:
        assert source.relative_to(ROOT).as_posix() in names


CHECK = """
import json, caramba
from caramba.runs import kernel_status
from caramba.model import isa
print(json.dumps({"file": caramba.__file__, "kernels": kernel_status(), "isa": isa.kernel_isa()}))
"""


@pytest.mark.integration   # builds every C library from scratch: about 2.5 minutes on 2 cores
def test_the_installed_wheel_builds_and_loads_every_kernel(wheel, tmp_path):
    """Installed with pip (non-editable, --no-deps: torch and the rest come from this venv) into a
    directory, run from outside the checkout so the installed copy is the one imported."""
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    env = {**os.environ, "PYTHONPATH": str(target), "CARAMBA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("CARAMBA_KERNELS", None)
    work = tmp_path / "elsewhere"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=work, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert Path(got["file"]).resolve().is_relative_to(target.resolve()), got["file"]
    assert got["kernels"] == dict.fromkeys(got["kernels"], "c"), got["kernels"]
    assert not got["isa"].startswith("eager") and "caramba: warning" not in done.stderr, done.stderr
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "kernels").glob("*.so")) == \
        ["decode_ops", "decode_step", "quant_attend", "quant_gemm", "quant_gemv"]
