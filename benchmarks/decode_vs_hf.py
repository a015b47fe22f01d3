"""caramba vs HF transformers `generate` on SmolLM2-135M, fp32, batch 1, greedy.

Both load the same GGUF independently. Runs alternate in one process (caramba, HF, caramba,
...) after a warm-up, and medians are reported. Decode throughput is measured the same way for
both: time(N new tokens) - time(1 new token) covers exactly N - 1 decode steps, so prefill is
excluded without touching either library's internals. EOS is ignored so every run makes N tokens.

    .venv/bin/python benchmarks/decode_vs_hf.py [--new-tokens 128] [--repeats 5] [--json out.json]
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

from caramba.infer import GenerateConfig, Generator  # noqa: E402
from caramba.model.zoo import load_model, resolve_source  # noqa: E402

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden screw press adapted from "
    "the presses that winemakers used in the Rhine valley"
)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def caramba_runner(model, ids: list[int], n: int, use_cache: bool = True):
    def go():
        if use_cache:
            Generator(model, GenerateConfig(max_new_tokens=n, temperature=0.0, max_seq_len=len(ids) + n)).run([ids])
            return
        seq = torch.tensor([ids])
        with torch.inference_mode():
            for _ in range(n):  # full recompute each step: the no-cache baseline
                nxt = model(seq, last_only=True)[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
    return go


def hf_runner(hf, ids: list[int], n: int, use_cache: bool = True):
    x = torch.tensor([ids])

    def go():
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, use_cache=use_cache, pad_token_id=0)
    return go


def decode_tok_s(run_n, run_1, n: int, repeats: int) -> tuple[float, list[float]]:
    """Median decode tok/s from paired (N tokens, 1 token) timings."""
    rates = []
    for _ in range(repeats):
        t_n, t_1 = timed(run_n), timed(run_1)
        rates.append((n - 1) / (t_n - t_1))
    return statistics.median(rates), rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-cache-tokens", type=int, default=32, help="new tokens for the (slow) no-cache comparison")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2-135m", "float32", "cpu")
    path = resolve_source("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = loaded.tokenizer.encode(PROMPT)[: args.prompt_tokens]
    assert len(ids) == args.prompt_tokens, f"prompt has only {len(ids)} tokens"
    n = args.new_tokens

    ours_n, ours_1 = caramba_runner(loaded.model, ids, n), caramba_runner(loaded.model, ids, 1)
    hf_n, hf_1 = hf_runner(hf, ids, n), hf_runner(hf, ids, 1)
    for fn in (ours_n, hf_n):  # warm-up: allocator, thread pool, first-call paths
        fn()

    ours_rates, hf_rates = [], []
    for _ in range(args.repeats):  # alternate so drift on a shared machine hits both alike
        ours_rates.append(decode_tok_s(ours_n, ours_1, n, 1)[0])
        hf_rates.append(decode_tok_s(hf_n, hf_1, n, 1)[0])
    ours, theirs = statistics.median(ours_rates), statistics.median(hf_rates)

    m = args.no_cache_tokens
    ours_nc = statistics.median(m / timed(caramba_runner(loaded.model, ids, m, use_cache=False)) for _ in range(3))
    ours_c = statistics.median(m / timed(caramba_runner(loaded.model, ids, m)) for _ in range(3))
    hf_nc = statistics.median(m / timed(hf_runner(hf, ids, m, use_cache=False)) for _ in range(3))
    hf_c = statistics.median(m / timed(hf_runner(hf, ids, m)) for _ in range(3))

    result = {
        "setup": {"model": "smollm2-135m (Q4_1 GGUF dequantized to fp32)", "batch": 1, "greedy": True,
                  "prompt_tokens": len(ids), "new_tokens": n, "repeats": args.repeats},
        "env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                "loadavg_1m_5m_15m": os.getloadavg()},
        "decode_tok_s": {"caramba": ours, "hf": theirs, "ratio": ours / theirs,
                         "caramba_samples": ours_rates, "hf_samples": hf_rates},
        "end_to_end_tok_s": {"new_tokens": m, "caramba_cache": ours_c, "caramba_no_cache": ours_nc,
                             "hf_cache": hf_c, "hf_no_cache": hf_nc,
                             "caramba_cache_speedup": ours_c / ours_nc, "hf_cache_speedup": hf_c / hf_nc},
    }
    print(f"decode tok/s (median of {args.repeats}): caramba {ours:.1f}  HF {theirs:.1f}  ratio {ours / theirs:.2f}x")
    print(f"end-to-end {m} tokens, tok/s: caramba cache {ours_c:.1f} / no cache {ours_nc:.1f}; "
          f"HF cache {hf_c:.1f} / no cache {hf_nc:.1f}")
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
