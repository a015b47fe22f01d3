"""What a press costs at prefill and saves at decode (issue 29): one long context, every press.

    .venv/bin/python benchmarks/press_speed.py [--weights native] [--context 4096] [--cache-kind fp32]
        [--presses none,snapkv@0.5,...] [--new-tokens 32] [--rounds 3] [--json FILE]

A press written PRESS+dense (e.g. ada_snapkv@0.5+dense) runs with per-head ragged layers kept at
their widest head's width instead of packed (caramba.cache.evict.PACK), to compare the layouts.

The context is a real task context (caramba.evaluation.tasks, niah_single_essay, chat-formatted) of
`--context` model tokens. Each round runs every press once through the Generator, in rotated
order so no press always goes first; per run: the time to the first token (prefill, scoring and
eviction) and the median decode step after it. Medians over rounds, with each press's ratio to
`none` from the same rounds: decode speedup and the prefill's extra seconds. The cache's
allocated bytes after the run are measured. The CPU, threads and load average are recorded
(caramba.runs.capture_env); on a busy machine the figures are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed_generation(model, ids: list[int], press: str, args):
    """(the Generator, time to first token, each decode step's seconds) of one greedy generation of
    args.new_tokens from `ids` with `press` (a PressConfig string) on an args.cache_kind cache."""
    from caramba.bench.measure import timed_tokens
    from caramba.infer import CacheConfig, GenerateConfig, Generator
    from caramba.press import PressConfig

    config = GenerateConfig(max_new_tokens=args.new_tokens, temperature=0.0, eos_token_id=None,
                            cache=CacheConfig(kind=args.cache_kind, press=PressConfig.parse(press)),
                            max_seq_len=len(ids) + args.new_tokens)
    gen = Generator(model, config)
    ttft, steps = timed_tokens(gen.generate_iter([ids]), model.device)
    return gen, ttft, steps


def run_press(model, ids: list[int], press: str, args) -> dict:
    """One run; a press ending in "+dense" keeps per-head ragged layers at their widest head's width
    (caramba.cache.evict.PACK = False) instead of packing them: the layout before packing, to compare."""
    import caramba.cache.evict as evict

    dense = press.endswith("+dense")
    evict.PACK = not dense
    try:
        gen, ttft, steps = timed_generation(model, ids, press.removesuffix("+dense"), args)
    finally:
        evict.PACK = True
    return {"ttft_s": ttft, "step_s": statistics.median(steps), "cache_bytes": gen.cache.nbytes,
            "kept_share": gen.state.kept_share}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="native")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--cache-kind", default="fp32")
    ap.add_argument("--presses", default="none,streaming_llm@0.5,knorm@0.5,snapkv@0.5,tova@0.5,observed_attention@0.5,"
                                          "expected_attention@0.5,pyramidkv@0.5,keydiff@0.5,ada_snapkv@0.5")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from caramba.evaluation import tasks
    from caramba.model.zoo import load_model
    from caramba.runs import capture_env

    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    if "none" not in presses:
        presses.insert(0, "none")
    lm = load_model("smollm2-135m", progress=False, weights=args.weights)
    ids = tasks.make_samples("niah_single_essay", args.context, 1, 0, lm.tokenizer, chat=True)[0].context_ids
    run_press(lm.model, ids[:256], "none", args)   # warm-up: kernels built, threads chosen
    env_before = capture_env(None, "cpu")
    runs: dict[str, list[dict]] = {p: [] for p in presses}
    for r in range(args.rounds):
        order = presses[r % len(presses):] + presses[: r % len(presses)]
        for press in order:
            runs[press].append(run_press(lm.model, ids, press, args))
            print(f"round {r + 1} {press}: ttft {runs[press][-1]['ttft_s']:.2f} s, "
                  f"step {1000 * runs[press][-1]['step_s']:.1f} ms", file=sys.stderr, flush=True)
    env_after = capture_env(None, "cpu")
    base_ttft = statistics.median(x["ttft_s"] for x in runs["none"])
    base_step = statistics.median(x["step_s"] for x in runs["none"])
    rows = []
    for press in presses:
        ttft = statistics.median(x["ttft_s"] for x in runs[press])
        step = statistics.median(x["step_s"] for x in runs[press])
        rows.append({"press": press, "ttft_s": ttft, "prefill_extra_s": ttft - base_ttft, "decode_tok_s": 1 / step,
                     "decode_speedup": base_step / step, "cache_mib": runs[press][-1]["cache_bytes"] / 2**20,
                     "kept_share": runs[press][-1]["kept_share"], "rounds": [x["step_s"] for x in runs[press]]})
    print(f"CPU {env_before['cpu_model']}, threads {env_before['threads']}, load average "
          f"{env_before['load_average']} -> {env_after['load_average']}, weights {args.weights}, "
          f"cache {args.cache_kind}, context {len(ids)} tokens, {args.new_tokens} new, {args.rounds} rounds (medians)")
    print("| press | time to first token (s) | prefill extra (s) | decode tok/s | decode speedup | cache MiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['press']} | {row['ttft_s']:.2f} | {row['prefill_extra_s']:+.2f} | {row['decode_tok_s']:.1f} | "
              f"{row['decode_speedup']:.2f}x | {row['cache_mib']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "context_tokens": len(ids),
                                         "env_before": env_before, "env_after": env_after, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
