"""What decoding-time compression (press_interval / press_target) costs and saves (issue 29).

    .venv/bin/python benchmarks/decoding_press.py [--weights native] [--context 2048] [--new-tokens 384]
        [--interval 128] [--target 1024] [--methods knorm,keydiff,streaming_llm,snapkv,tova,expected_attention]
        [--rounds 2] [--json FILE]

One real task context (niah_single_essay, chat) of `--context` tokens is prefilled unpressed and
`--new-tokens` tokens are generated greedily through the Generator: without a press, and with each
method compressing every `--interval` generated tokens down to `--target` tokens per head
(`METHOD@0/INTERVAL:TARGET`). Per run, from the latency of every token after the first: the mean
decode step (what a long generation pays, compressions included), the median step (a step that
does not compress), and the extra time of the steps that compressed (their latency minus the
median; a query method's watched steps run on torch instead of the C step and are in the mean).
Each round runs every variant once in rotated order; medians over rounds, ratios to no press from
the same rounds. The cache's allocated bytes at the end are measured. The CPU, threads and load
average are recorded (caramba.runs.capture_env): on a busy machine the figures are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from press_speed import timed_generation  # noqa: E402  (benchmarks/press_speed.py: one generation, timed)


def run_variant(model, ids: list[int], press: str, args) -> dict:
    gen, ttft, steps = timed_generation(model, ids, press, args)
    median = statistics.median(steps)
    compressed = [i for i in range(len(steps)) if (i + 1) % args.interval == 0] if press != "none" else []
    return {"ttft_s": ttft, "mean_step_s": statistics.fmean(steps), "median_step_s": median,
            "compress_extra_s": statistics.fmean(steps[i] - median for i in compressed) if compressed else 0.0,
            "compressions": gen.decoding.compressions if gen.decoding is not None else 0,
            "cache_bytes": gen.cache.nbytes, "cache_length": gen.cache.length}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="native")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--cache-kind", default="fp32")
    ap.add_argument("--new-tokens", type=int, default=384)
    ap.add_argument("--interval", type=int, default=128)
    ap.add_argument("--target", type=int, default=1024)
    ap.add_argument("--methods", default="knorm,keydiff,streaming_llm,snapkv,tova,expected_attention")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from caramba.evaluation import tasks
    from caramba.model.zoo import load_model
    from caramba.runs import capture_env

    variants = ["none"] + [f"{m.strip()}@0/{args.interval}:{args.target}" for m in args.methods.split(",") if m.strip()]
    lm = load_model("smollm2-135m", progress=False, weights=args.weights)
    ids = tasks.make_samples("niah_single_essay", args.context, 1, 0, lm.tokenizer, chat=True)[0].context_ids
    warm = argparse.Namespace(**{**vars(args), "new_tokens": 8})
    run_variant(lm.model, ids[:256], "none", warm)   # warm-up: kernels built, threads chosen
    env_before = capture_env(None, "cpu")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            runs[v].append(run_variant(lm.model, ids, v, args))
            x = runs[v][-1]
            print(f"round {r + 1} {v}: mean step {1000 * x['mean_step_s']:.1f} ms, median {1000 * x['median_step_s']:.1f} "
                  f"ms, compress +{1000 * x['compress_extra_s']:.0f} ms x{x['compressions']}", file=sys.stderr, flush=True)
    env_after = capture_env(None, "cpu")

    def med(v: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[v])

    base_mean = med("none", "mean_step_s")
    rows = [{"press": v, "decode_tok_s": 1 / med(v, "mean_step_s"), "speedup": base_mean / med(v, "mean_step_s"),
             "median_step_ms": 1000 * med(v, "median_step_s"), "compress_extra_ms": 1000 * med(v, "compress_extra_s"),
             "compressions": runs[v][-1]["compressions"], "cache_mib": runs[v][-1]["cache_bytes"] / 2**20,
             "cache_length": runs[v][-1]["cache_length"], "rounds": [x["mean_step_s"] for x in runs[v]]}
            for v in variants]
    print(f"CPU {env_before['cpu_model']}, threads {env_before['threads']}, load average "
          f"{env_before['load_average']} -> {env_after['load_average']}, weights {args.weights}, cache "
          f"{args.cache_kind}, context {len(ids)} tokens, {args.new_tokens} new, {args.rounds} rounds (medians)")
    print("| press | decode tok/s (mean step) | vs none | median step (ms) | per compression (ms) | compressions | "
          "cache MiB at the end |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['press']} | {row['decode_tok_s']:.1f} | {row['speedup']:.2f}x | {row['median_step_ms']:.1f} | "
              f"{row['compress_extra_ms']:+.0f} | {row['compressions']} | {row['cache_mib']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "context_tokens": len(ids),
                                         "env_before": env_before, "env_after": env_after, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
