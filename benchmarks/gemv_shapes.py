"""One GEMV per SmolLM2-135M projection shape, x [1, K]: torch fp32 against the quantized-weight
kernels of caramba.model.quant (q8_0 and q4_1, with q8, int16 or fp32 activations).

    .venv/bin/python benchmarks/gemv_shapes.py [--threads 1] [--repeats 3]

Medians of --repeats rounds; every round times each variant in turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gguf
import torch

from caramba.model import quant
from caramba.model.quant import QuantLinear

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536), "head": (49152, 576)}


def timed(f, n: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, kernels {quant.status()}, load average {os.getloadavg()}")
    with torch.inference_mode():
        for name, (N, K) in SHAPES.items():
            w, x = torch.randn(N, K), torch.randn(1, K)
            wt = w.t().contiguous()
            p = quant.gguf_blocks(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1), "Q4_1", (N, K))
            variants = {
                "fp32 F.linear": lambda: torch.nn.functional.linear(x, w),
                "fp32 x@W^T": lambda: x @ wt,
                "q8_0*q8": QuantLinear.from_float(w, act="q8"),
                "q8_0*f32": QuantLinear.from_float(w, act="f32"),
                "q4_1*f32": QuantLinear("q4_1", p["qs"], p["d"], p["m"], act="f32"),
                "q4_1*q8": QuantLinear("q4_1", p["qs"], p["d"], p["m"], act="q8"),
                "q8_0*i16": QuantLinear.from_float(w, act="i16"),
                "q4_1*i16": QuantLinear("q4_1", p["qs"], p["d"], p["m"], act="i16"),
            }
            n = 20 if name == "head" else 200
            times = {k: [] for k in variants}
            for _ in range(args.repeats):
                for k, f in variants.items():
                    times[k].append(timed(lambda: f(x), n) if isinstance(f, QuantLinear) else timed(f, n))
            print(f"{name} {N}x{K}: " + "  ".join(f"{k} {statistics.median(v):.0f} us" for k, v in times.items()))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
