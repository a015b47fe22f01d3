"""One GEMV per SmolLM2-135M projection shape, x [1, K]: torch fp32 against the quantized-weight
kernels of caramba.model.quant (q8_0 and q4_1, with q8, int16 or fp32 activations).

    .venv/bin/python benchmarks/gemv_shapes.py [--threads 1] [--repeats 3] [--isa avx2,avx512vnni] [--cpu-time]

Medians of --repeats rounds; every round times each variant in turn. --isa times each quantized
variant at each of these instruction set levels (caramba.model.isa) in the same round: an A/B of
the kernels. --cpu-time clocks this process's CPU time (all threads) instead of the wall: on a busy
machine a descheduled thread then costs nothing, so a kernel A/B survives other people's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gguf
import torch

from caramba.model import isa, quant
from caramba.model.quant import QuantLinear

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536), "head": (49152, 576)}


def timed(f, n: int, clock=time.perf_counter) -> float:
    f()
    t0 = clock()
    for _ in range(n):
        f()
    return (clock() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--isa", default=None, help=f"comma-separated levels ({', '.join(isa.LEVELS)}; default: the one chosen)")
    ap.add_argument("--cpu-time", action="store_true", help="time by process CPU time, not the wall clock")
    args = ap.parse_args()
    levels = [v.strip() for v in args.isa.split(",")] if args.isa else [None]
    if any(v is not None and v not in isa.LEVELS for v in levels):
        ap.error(f"--isa: use levels among {', '.join(isa.LEVELS)}")
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, kernels {quant.status()} at {isa.kernel_isa()}, "
          f"levels timed {[isa.resolve(v) if v else isa.kernel_isa() for v in levels]}, "
          f"{'CPU' if args.cpu_time else 'wall'} time, load average {os.getloadavg()}")
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
                "q4_0*q8": QuantLinear.from_float(w, act="q8", fmt="q4_0"),
            }
            for k in [k for k, f in variants.items() if isinstance(f, QuantLinear) and levels != [None]]:
                f = variants.pop(k)
                variants.update({f"{k}@{v}": (f, v) for v in levels})
            n = 20 if name == "head" else 200
            times = {k: [] for k in variants}
            for _ in range(args.repeats):
                for k, f in variants.items():
                    if isinstance(f, tuple):
                        with isa.use_isa(f[1]):
                            times[k].append(timed(lambda: f[0](x), n, clock))
                    else:
                        times[k].append(timed(lambda: f(x), n, clock) if isinstance(f, QuantLinear) else timed(f, n, clock))
            print(f"{name} {N}x{K}: " + "  ".join(f"{k} {statistics.median(v):.0f} us" for k, v in times.items()))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
