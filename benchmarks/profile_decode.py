"""torch.profiler over batch-1 decode steps of SmolLM2-135M: where a step's time goes, per aten op.

    .venv/bin/python benchmarks/profile_decode.py [--threads 1] [--weights fp32] [--steps 20]

Prints the unprofiled ms per step, then the profiler's table (self CPU time, calls, avg) and the
load average. See docs/decode-speed.md for what the fp32 table showed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from caramba.model.zoo import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=25, help="rows of the profiler table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", progress=False, weights=args.weights)
    m = lm.model
    ids = torch.tensor([lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a time")])
    with torch.inference_mode():
        cache = m.new_cache(1, ids.shape[1] + 2 * args.steps + 8)
        tok = m(ids, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        for _ in range(5):
            tok = m(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok = m(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
        print(f"decode step: {(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms (unprofiled), "
              f"weights {args.weights}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                tok = m(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
