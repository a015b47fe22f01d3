"""One prefill-sized product per SmolLM2-135M projection shape, x [M, K]: fp32 (caramba.gemm.dense,
what an fp32 layer runs) against the quantized layers' prefill paths (caramba.model.quant_gemm).

    .venv/bin/python benchmarks/gemm_shapes.py [--rows 512,2048] [--threads 1] [--repeats 7]

Variants, each timed in turn in every round (medians of --repeats rounds, ms):
  fp32        gemm.dense on the fp32 weight
  q8_0, q4_0  the int8 GEMM alone on q8 codes (quant_gemm.gemm at the level in force)
  q8_0 layer, q4_0 layer   QuantLinear.forward: the activations quantized, then that GEMM
  native layer             QuantLinear.forward of a Q4_1 layer with fp32 activations: AMX-BF16
                           where the CPU has it, else a dequantized tile and gemm.dense
  dequantize               the Q4_1 weight's dequantization alone (the native layer's extra cost)
The header names the CPU, the GEMM level (set CARAMBA_ISA to cap it; to stand in for an AVX2-only
CPU cap torch too: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), threads and load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.quant_prefill import cpu_model  # noqa: E402
from caramba import gemm  # noqa: E402
from caramba.model import quant, quant_gemm  # noqa: E402
from caramba.model.quant import QuantLinear  # noqa: E402

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536)}


def variants(M: int, N: int, K: int) -> dict:
    g = torch.Generator().manual_seed(N + K)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    out = {"fp32": lambda: gemm.dense(x, w)}
    for fmt in ("q8_0", "q4_0"):
        lin = QuantLinear.from_float(w, fmt=fmt, act="q8")
        if quant_gemm.runs(fmt):
            xq, xd = quant.quantize_rows_codes(x, "q8")
            qs, d = lin.row_major()[:2]
            out[fmt] = lambda fmt=fmt, xq=xq, xd=xd, qs=qs, d=d: quant_gemm.gemm(fmt, xq, xd, qs, d, N)
        out[f"{fmt} layer"] = lambda lin=lin: lin(x)
    codes = torch.randint(0, 16, (N, K), generator=g)
    native = QuantLinear("q4_1", quant.pack_nibbles(codes), (torch.rand(N, K // 32, generator=g) * 0.05).half(),
                         (-torch.rand(N, K // 32, generator=g) * 0.4).half(), act="f32")
    quant.relayout(native)
    out["native layer"] = lambda: native(x)
    out["dequantize"] = lambda: native.dequantized()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="512,2048", help="comma-separated activation rows (prompt tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"{cpu_model()}, {args.threads} thread(s), torch {torch.__version__}; int8 GEMM at {quant_gemm.level()}; "
          f"load average before {load[0]:.2f}; medians of {args.repeats}, ms")
    with torch.inference_mode():
        for M in (int(m) for m in args.rows.split(",")):
            for name, (N, K) in SHAPES.items():
                fns = variants(M, N, K)
                times = {v: [] for v in fns}
                for r in range(args.repeats + 1):     # round 0: warm-up
                    for v, f in fns.items():
                        t0 = time.perf_counter()
                        f()
                        if r:
                            times[v].append((time.perf_counter() - t0) * 1e3)
                med = {v: statistics.median(t) for v, t in times.items()}
                cells = ", ".join(f"{v} {t:.2f}" for v, t in med.items())
                print(f"{name} [{M}, {K}] x [{K}, {N}]: {cells}; fp32 / q8_0 layer {med['fp32'] / med['q8_0 layer']:.2f}x, "
                      f"fp32 / native layer {med['fp32'] / med['native layer']:.2f}x")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
