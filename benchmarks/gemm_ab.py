"""A/B of two builds of the prefill GEMM (caramba/model/quant_gemm.c): a git revision's against
the working tree's, loaded side by side in one process, timed in alternation on every SmolLM2-135M
projection shape, and checked to give the same bits.

    .venv/bin/python benchmarks/gemm_ab.py --base REV [--level avx512vnni] [--rows 512,2048]
        [--threads 1] [--repeats 9] [--march haswell] [--formats q8_0,q4_0] [--layout x16]

--march builds both with another -march than native (e.g. haswell or znver3: what an AVX2-only
CPU compiles, with its 16 vector registers; alderlake for avxvnni), for a CPU this one can run.
Reported per shape: the medians of --repeats rounds of 3 calls, base / tree ms and their ratio,
the CPU, the level, the threads and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quant_prefill import cpu_model  # noqa: E402
from caramba import kernels  # noqa: E402
from caramba.model import quant, quant_gemm  # noqa: E402
from caramba.model.quant import QuantLinear  # noqa: E402

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536)}
MODEL = ROOT / "caramba" / "model"


def sources_at(rev: str, into: Path) -> Path:
    """quant_gemm.c and the files it is compiled with, as they were at `rev`."""
    for name in ("quant_gemm.c", "cpu_isa.c", "cpu_isa.h", "amx_emulate.h"):
        shown = subprocess.run(["git", "show", f"{rev}:caramba/model/{name}"], cwd=ROOT, capture_output=True)
        if shown.returncode == 0:
            (into / name).write_bytes(shown.stdout)
        elif name.endswith(".c"):
            raise SystemExit(f"git show {rev}:caramba/model/{name}: {shown.stderr.decode().strip()}")
    return into


def build(where: Path, march: str | None, level: str):
    flags = [f if not (march and f.startswith("-march")) else f"-march={march}" for f in kernels.FLAGS]
    lib, status = kernels.load([where / "quant_gemm.c", where / "cpu_isa.c"], quant_gemm._SIGNATURES,
                               "gemm A/B", flags)
    if lib is None:
        raise SystemExit(f"build of {where}: {status}")
    if lib.gemm_isa_set(level.encode()) < 0 or lib.gemm_isa_name().decode() != level:
        raise SystemExit(f"level {level} is not available here (got {lib.gemm_isa_name().decode()})")
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--level", default="avx512vnni", choices=[lv for lv in quant_gemm.LEVELS if lv != "scalar"])
    ap.add_argument("--rows", default="512,2048")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--march", default=None, help="build both with -march=MARCH instead of native")
    ap.add_argument("--formats", default="q8_0,q4_0")
    ap.add_argument("--layout", default="x16", choices=["x16", "rows"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gemm_ab_"))
    try:
        libs = {"base": build(sources_at(args.base, tmp), args.march, args.level),
                "tree": build(MODEL, args.march, args.level)}
        print(f"{cpu_model()}, {args.threads} thread(s), level {args.level}, -march={args.march or 'native'}, "
              f"base {args.base}, load average before {os.getloadavg()[0]:.2f}; medians of {args.repeats}, ms")
        for rows in map(int, args.rows.split(",")):
            for fmt in args.formats.split(","):
                for name, (N, K) in SHAPES.items():
                    lin = QuantLinear.from_float(torch.randn(N, K), fmt=fmt, act="q8")
                    lin.relayout(args.layout)
                    xq, xd = quant.quantize_rows_codes(torch.randn(rows, K), "q8")
                    outs = {k: torch.empty(rows, N) for k in libs}
                    times: dict[str, list[float]] = {k: [] for k in libs}
                    for _ in range(args.repeats):
                        for k, lib in libs.items():
                            call = (quant_gemm.FORMATS[fmt], xq.data_ptr(), xd.data_ptr(), rows, K, lin.qs.data_ptr(),
                                    lin.d.data_ptr(), int(args.layout == "x16"), N, outs[k].data_ptr(), args.threads)
                            lib.gemm_q8(*call)
                            t0 = time.perf_counter()
                            for _ in range(3):
                                lib.gemm_q8(*call)
                            times[k].append((time.perf_counter() - t0) / 3 * 1e3)
                    base, tree = statistics.median(times["base"]), statistics.median(times["tree"])
                    bits = "same bits" if torch.equal(outs["base"], outs["tree"]) else "BITS DIFFER"
                    print(f"{fmt} {name} [{rows}, {K}] x [{K}, {N}]: base {base:.3f}, tree {tree:.3f}, "
                          f"{base / tree:.2f}x, {bits}")
        print(f"load average after {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
