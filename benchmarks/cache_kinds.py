"""Decode speed and memory of each KV cache kind on SmolLM2-135M at a long context.

For each kind the context (default 2048 tokens of caramba's corpus) is prefilled once; each
repeat then rolls the cache back to the context (truncate) and times `--steps` single-token
greedy decode steps. Kinds alternate within every repeat, after a warm-up; medians are reported.
Also prints, per kind, the bytes the cache allocated next to the analytic bytes/token formula.

    .venv/bin/python benchmarks/cache_kinds.py [--context 2048] [--steps 32] [--repeats 5]
        [--kinds fp32,q8_0,q4_0,nf4] [--qblock 32] [--residual-len 0] [--chunk 512] [--torch-path]
        [--weights fp32|q8_0|q4_0|native|native_i16] [--json out.json]

Every kind (per-channel values excepted) decodes through the one-call C step
(caramba.model.fast_decode.CStep, chosen as a Generator chooses it: caramba.model.backend); the
others through the torch path, reading codes with the C kernels (caramba.cache.kernel) when they
build. --torch-path sends every kind through the torch path (backend.TorchStep: like for like with
the kinds the C step does not take); CARAMBA_KERNELS=0 times the eager path. The `step` column
says which path each kind's steps took. --weights: quantized weights make the rest of the
step faster, so the cache read is a larger share of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import caramba.cache.attend as attend  # noqa: E402
from caramba.cache import kernel  # noqa: E402
from caramba.cache import CachePolicy  # noqa: E402
from caramba.evaluation.evaluate import corpus_ids  # noqa: E402
from caramba.model import fast_decode  # noqa: E402
from caramba.model.backend import Backend, TorchStep, choose  # noqa: E402
from caramba.model.quant import WEIGHT_KINDS  # noqa: E402
from caramba.model.zoo import load_model  # noqa: E402


@torch.inference_mode()
def decode_steps(forward: Backend, cache, context: int, first: torch.Tensor, steps: int) -> float:
    """Roll back to the context, then time `steps` greedy one-token forwards through the backend."""
    cache.truncate(context)
    tok = first
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = forward(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", default="fp32,q8_0,q4_0,nf4", help="comma-separated kinds (or policies as k=..;v=..)")
    ap.add_argument("--qblock", type=int, default=32, help="quantization block (per-channel kinds: tokens per group)")
    ap.add_argument("--residual-len", type=int, default=0,
                    help="newest tokens also kept in full precision (KIVI's window; autotune's KIVI-2 uses 128)")
    ap.add_argument("--chunk", type=int, default=attend.READ_CHUNK, help="tokens per dequantized chunk (eager path)")
    ap.add_argument("--torch-path", action="store_true",
                    help="every kind through the torch path (caramba.model.backend.TorchStep): the C decode step "
                         "(caramba.model.fast_decode.CStep) takes every kind but per-channel values")
    ap.add_argument("--weights", default="fp32", choices=WEIGHT_KINDS, help="weight format (default fp32)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    attend.READ_CHUNK = args.chunk

    loaded = load_model(args.model, "float32", "cpu", progress=False, weights=args.weights)
    model = loaded.model
    ids = corpus_ids(loaded.tokenizer)
    if len(ids) < args.context + 1:
        ids = (ids * (args.context // len(ids) + 2))
    context = torch.tensor([ids[: args.context]])
    first = torch.tensor([[ids[args.context]]])
    kinds = args.kinds.split(",")
    caches = {}
    for kind in kinds:
        policy = CachePolicy.build(policy=kind.replace(";", ","), qblock=args.qblock, residual_len=args.residual_len) \
            if "=" in kind else CachePolicy.build(kind, qblock=args.qblock, residual_len=args.residual_len)
        cache = model.new_cache(1, args.context + args.steps, policy)
        with torch.inference_mode():
            model(context, cache=cache, last_only=True)
        caches[kind] = cache
    # one backend per kind, so that each says which path its steps took
    forwards = {kind: TorchStep(model) if args.torch_path else choose(model) for kind in kinds}
    for kind in kinds:  # warm-up
        decode_steps(forwards[kind], caches[kind], args.context, first, 4)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for kind in kinds:
            times[kind].append(args.steps / decode_steps(forwards[kind], caches[kind], args.context, first, args.steps))

    cfg = model.config
    print(f"SmolLM2 decode at context {args.context}, {args.steps} steps x {args.repeats} repeats, "
          f"weights {args.weights}, qblock {args.qblock}, residual_len {args.residual_len}, torch {torch.__version__}, threads {torch.get_num_threads()}, kernels {kernel.status()}, chunk {args.chunk}, "
          f"decode step {'torch path' if args.torch_path else 'C where the step column says: ' + fast_decode.status()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'kind':<16}{'step':>6}{'tok/s':>8}{'vs fp32':>9}{'bytes/token':>13}{'analytic':>10}{'allocated MiB':>15}")
    rows = []
    base = statistics.median(times[kinds[0]])
    for kind in kinds:
        cache = caches[kind]
        rate = statistics.median(times[kind])
        # Analytic: per layer, K and V of n_kv_heads heads (codes + fp16 block scales).
        analytic = sum(layer.k_cfg.bytes_per_token(cfg.n_kv_heads, cfg.head_dim)
                       + layer.v_cfg.bytes_per_token(cfg.n_kv_heads, cfg.head_dim) for layer in cache.layers)
        allocated_per_token = cache.nbytes / cache.max_seq_len
        step = {"c": "C", "torch": "torch"}.get(forwards[kind].path, "both")
        rows.append({"kind": kind, "step": step, "tok_s": rate, "samples": times[kind], "vs_first": rate / base,
                     "bytes_per_token": cache.bytes_per_token(), "analytic_bytes_per_token": analytic,
                     "allocated_bytes": cache.nbytes, "allocated_per_token": allocated_per_token})
        print(f"{kind:<16}{step:>6}{rate:>8.2f}{rate / base:>9.3f}{cache.bytes_per_token():>13}{analytic:>10}"
              f"{cache.nbytes / 2**20:>15.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "steps": args.steps, "repeats": args.repeats, "chunk": args.chunk,
                       "qblock": args.qblock, "weights": args.weights,
                       "threads": torch.get_num_threads(), "torch": torch.__version__, "kernels": kernel.status(),
                       "cpu": platform.processor() or platform.machine(), "loadavg": os.getloadavg(), "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
