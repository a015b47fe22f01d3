"""generate_batched throughput on SmolLM2-135M, fp32, greedy: batch 8 (and "auto") vs batch 1.

The same 16 prompts of mixed lengths (8..64 tokens) run through `generate_batched` with each
batch size; EOS is ignored so every prompt makes exactly --new-tokens tokens. Configurations
alternate in one process after a warm-up; medians of end-to-end tokens/s (prefill included)
are reported, with torch's thread count and the load average.

    .venv/bin/python benchmarks/batched_throughput.py [--new-tokens 32] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from caramba.infer import GenerateConfig, generate_batched  # noqa: E402
from caramba.model.zoo import load_model  # noqa: E402

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type with an oil-based ink and a wooden screw press adapted from the presses that winemakers used in the "
    "Rhine valley. Within fifty years, presses were at work in more than two hundred cities across Europe, and the "
    "price of books fell so far that ordinary merchants could own them."
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    loaded = load_model("smollm2-135m", "float32", "cpu", progress=False)
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
    assert outputs["1"] == outputs["8"] == outputs["auto"], "batching changed a greedy output"
    med = {s: statistics.median(r) for s, r in rates.items()}
    report = {
        "model": "smollm2-135m fp32", "prompts": args.prompts, "prompt_lens": sorted(lengths),
        "new_tokens": args.new_tokens, "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "loadavg_after": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
        "tok_s_median": med, "tok_s_all": rates, "speedup_8_vs_1": med["8"] / med["1"],
        "speedup_auto_vs_1": med["auto"] / med["1"], "auto": chosen,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
