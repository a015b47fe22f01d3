"""Sliding-window decode (`--local-window 512`) against the ordinary step, SmolLM2-135M fp32, greedy.

Variants alternate in one process (repeat r: each variant once), medians reported as tok/s of
generate() for --new-tokens tokens (a 17-token prompt's prefill included, the same in each):
  no window            the fused C step (caramba.model.fast_decode.CStep)
  window               decode_local_window=512: a ring buffer, the C step until the ring wraps
  window, torch path   the same with every ring refused by CStep.applies (before issue 32)
  no window, torch     the ordinary torch path (model.fast_decode = False), for scale
All four give the same tokens while prompt + new tokens stay inside the window (checked).

    .venv/bin/python benchmarks/window_decode.py [--new-tokens 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from caramba.cache.ring import RingKVCache
from caramba.infer import GenerateConfig, Generator
from caramba.model import fast_decode
from caramba.model.zoo import load_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", progress=False)
    ids = torch.tensor([loaded.tokenizer.encode(PROMPT)])
    real = fast_decode.CStep.applies

    def ring_refused(step, tokens, cache, *rest):   # CStep.applies as it was: every ring refused
        return type(cache) is not RingKVCache and real(step, tokens, cache, *rest)

    variants = {"no window": (None, real, True), "window": (512, real, True),
                "window, torch path": (512, ring_refused, True), "no window, torch": (None, real, False)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs = {}
    n = args.new_tokens
    for _ in range(args.repeats):
        for name, (window, applies, fast) in variants.items():
            fast_decode.CStep.applies, loaded.model.fast_decode = applies, fast
            plan = {} if window is None else {"decode_plan": "fixed", "decode_local_window": window}
            config = GenerateConfig(max_new_tokens=n, min_new_tokens=n, temperature=0.0, max_seq_len=1024, **plan)
            began = time.perf_counter()
            outputs[name] = Generator(loaded.model, config, tokenizer=loaded.tokenizer).generate(ids)
            times[name].append(time.perf_counter() - began)
    fast_decode.CStep.applies, loaded.model.fast_decode = real, True
    print(f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"{ids.shape[1]}-token prompt, {n} new tokens, {args.repeats} repeats")
    base = statistics.median(times["no window"])
    for name, ts in times.items():
        print(f"{name:20s} {n / statistics.median(ts):7.2f} tok/s (median; x{base / statistics.median(ts):.3f} of "
              f"no window's speed)  runs: {', '.join(f'{n / t:.2f}' for t in ts)}")
    print("same tokens in every variant:", all(torch.equal(outputs["no window"], o) for o in outputs.values()))


if __name__ == "__main__":
    main()
