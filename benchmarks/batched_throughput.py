"""generate_batched throughput on SmolLM2-135M, greedy: batch 8 (and "auto") vs batch 1.

The same 16 prompts of mixed lengths (8..64 tokens) run through `generate_batched` with each
batch size; EOS is ignored so every prompt makes exactly --new-tokens tokens. Configurations
alternate in one process after a warm-up; medians of end-to-end tokens/s (prefill included)
are reported, with torch's thread count and the load average. Then the decode step alone at
batch 1, 2, 4 and 8 (40-token prompts, --new-tokens steps, medians of --repeats): `step_ms_median`.

--llamacpp adds the anchor to the step timings: llama.cpp's `llama-batched-bench` on the same
weights in its format (fp32: F32, q8_0: Q8_0, q4_0: Q4_0, native and native_i16: Q4_1), 40-token
prompts and --new-tokens steps at batch 1 and 8, one run after each repeat of ours. Its decode
tok/s at batch 8 against batch 1 is the ratio the same CPU gives llama.cpp's batches; its
prefill-and-decode tok/s is reported beside it. llama.cpp is built by benchmarks/llamacpp.py, never
in CI.

    .venv/bin/python benchmarks/batched_throughput.py [--weights fp32|q8_0|q4_0|native|native_i16] [--new-tokens 32]
        [--repeats 3] [--llamacpp [--sdist FILE]] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import llamacpp  # noqa: E402  (benchmarks/llamacpp.py)

from caramba.infer import GenerateConfig, generate_batched  # noqa: E402
from caramba.model.backend import choose  # noqa: E402
from caramba.model.quant import WEIGHT_KINDS  # noqa: E402
from caramba.model.zoo import load_model  # noqa: E402

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type with an oil-based ink and a wooden screw press adapted from the presses that winemakers used in the "
    "Rhine valley. Within fifty years, presses were at work in more than two hundred cities across Europe, and the "
    "price of books fell so far that ordinary merchants could own them."
)


@torch.inference_mode()
def step_ms(model, batch: int, prompt_len: int = 40, steps: int = 32) -> float:
    """ms per decode step of `batch` rows (one new token each) after a prompt_len-token prefill:
    the step alone, without generation's bookkeeping or prefill, through the backend a Generator
    chooses (caramba.model.backend: the fused C step up to its 16 token rows)."""
    forward = choose(model)
    ids = torch.randint(0, 1000, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
    cache = model.new_cache(batch, prompt_len + steps + 4)
    forward(ids, cache=cache)
    tok = ids[:, -1:]
    for _ in range(3):
        forward(tok, cache=cache)
    cache.truncate(prompt_len)
    t0 = time.perf_counter()
    for _ in range(steps):
        forward(tok, cache=cache)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--weights", default="fp32", choices=WEIGHT_KINDS, help="weight format (default fp32)")
    ap.add_argument("--llamacpp", action="store_true", help="also time llama-batched-bench on the same weights")
    ap.add_argument("--sdist", default=None, help="llama_cpp_python-*.tar.gz (default: newest in /tmp/lcp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gguf = None
    if args.llamacpp:
        tools = llamacpp.build(["llama-batched-bench", "llama-quantize"], args.sdist)
        fmt = llamacpp.LLAMA_FORMAT[args.weights]
        gguf = llamacpp.models(tools, [fmt])[fmt]

    loaded = load_model("smollm2-135m", "float32", "cpu", progress=False, weights=args.weights)
    words = loaded.tokenizer.encode(TEXT)
    lengths = [8 + (i * 37) % 57 for i in range(args.prompts)]            # 8..64 tokens, mixed
    prompts = [words[i % 7 : i % 7 + n] for i, n in enumerate(lengths)]
    cfg = GenerateConfig(max_new_tokens=args.new_tokens, temperature=0.0, eos_token_id=[], max_seq_len=128)
    sizes: list[int | str] = [1, 8, "auto"]
    generate_batched(loaded.model, prompts[:8], 8, cfg)                    # warm-up
    rates: dict[str, list[float]] = {str(s): [] for s in sizes}
    chosen = {}
    outputs = {}
    for _ in range(args.repeats):
        for s in sizes:                                                     # alternate configurations
            res = generate_batched(loaded.model, prompts, s, cfg)
            rates[str(s)].append(res.tok_s)
            outputs[str(s)] = res.sequences
            if s == "auto":
                chosen = {"batch_size": res.batch_size, **res.sizing}
    # With fp32 activations (fp32, native) a batch changes only fp32 summation orders, and greedy
    # outputs must agree. q8_0 and q4_0 round activations to q8 on every path, which turns those
    # order differences (a padded batch's prefill takes other GEMM blocking) into whole q8 steps
    # now and then, so there the agreement is reported, as llama.cpp's batches would need too
    # (native_i16 likewise, with steps 256 times finer).
    agree = {s: sum(a == b for a, b in zip(outputs["1"], outputs[s])) for s in ("8", "auto")}
    if args.weights in ("fp32", "native"):
        assert all(n == len(prompts) for n in agree.values()), f"batching changed a greedy output: {agree}"
    med = {s: statistics.median(r) for s, r in rates.items()}
    step_runs: dict[int, list[float]] = {b: [] for b in (1, 2, 4, 8)}
    llama_runs: list[list[dict]] = []
    for _ in range(args.repeats):                                           # ours, then llama.cpp's, alternating
        for b in step_runs:
            step_runs[b].append(step_ms(loaded.model, b, steps=args.new_tokens))
        if gguf is not None:
            rows, llama_command = llamacpp.batched_bench(tools, gguf, 40, args.new_tokens, [1, 8],
                                                         torch.get_num_threads())
            llama_runs.append(rows)
    steps = {b: statistics.median(r) for b, r in step_runs.items()}
    report = {
        "model": "smollm2-135m", "weights": args.weights, "prompts": args.prompts, "prompt_lens": sorted(lengths),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "loadavg_after": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
        "tok_s_median": med, "tok_s_all": rates, "speedup_8_vs_1": med["8"] / med["1"],
        "speedup_auto_vs_1": med["auto"] / med["1"], "auto": chosen,
        "greedy_outputs_equal_to_batch_1": {s: f"{n}/{len(prompts)}" for s, n in agree.items()},
        "step_ms_median": steps, "step_ms_all": step_runs, "step_tok_s": {b: b * 1e3 / ms for b, ms in steps.items()},
        "step_speedup_8_vs_1": (8 / steps[8]) / (1 / steps[1]),
    }
    if llama_runs:
        def median(batch: int, key: str) -> float:
            return statistics.median(next(r[key] for r in rows if r["pl"] == batch) for rows in llama_runs)

        tg = {b: median(b, "speed_tg") for b in (1, 8)}
        report["llamacpp"] = {
            "gguf": str(gguf), "command": llama_command, "decode_tok_s_median": tg,
            "decode_speedup_8_vs_1": tg[8] / tg[1],
            "prefill_and_decode_tok_s_median": {b: median(b, "speed") for b in (1, 8)},
            "runs": llama_runs,
        }
        report["step_tok_s_vs_llamacpp_decode"] = {b: (b * 1e3 / steps[b]) / tg[b] for b in (1, 8)}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
