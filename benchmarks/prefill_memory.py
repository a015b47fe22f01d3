"""Prefill peak memory and time of a long prompt on SmolLM2-135M, unchunked vs decode-plan chunks.

Every configuration runs in a fresh subprocess (so one's allocations cannot raise another's
high-water mark): it loads the model, warms up on a short prompt, resets the RSS high-water mark
(/proc/self/clear_refs, as caramba.bench.measure.PeakMemory does), then prefills the prompt
(`--prompt` tokens of caramba's corpus, max_new_tokens=1) `--repeats` times with a fresh
Generator each time. Reported per configuration: peak RSS (VmHWM), the RSS just before the
prefill, their difference (what the prefill itself added: cache + activations), median prefill
time, and the KV cache's bytes. Configurations alternate within each round. Then one process
times every configuration again, alternating, `--time-rounds` rounds after a warm-up round
(the ratios to unchunked come from there).

    flock /tmp/caramba-heavy.lock .venv/bin/python benchmarks/prefill_memory.py \
        [--prompt 4096] [--chunks 256,512,1024] [--window 512] [--rounds 2] [--repeats 2]
        [--time-rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    """One configuration, in this process: prints one JSON line."""
    import torch

    from caramba.bench.measure import PeakMemory
    from caramba.infer import GenerateConfig, Generator
    from caramba.evaluation.evaluate import corpus_ids
    from caramba.model.zoo import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "float32", "cpu", progress=False)
    ids = corpus_ids(loaded.tokenizer)
    prompt = (ids * (args.prompt // len(ids) + 1))[: args.prompt]
    plan = {} if args.q_chunk == 0 and not args.window else {
        "decode_plan": "fixed", "decode_q_chunk": args.q_chunk or None, "decode_local_window": args.window or None}
    config = GenerateConfig(max_new_tokens=1, temperature=0.0, eos_token_id=None, max_seq_len=args.prompt + 1, **plan)
    import warnings

    warnings.simplefilter("ignore")   # the window warning: this benchmark sets it on purpose
    Generator(loaded.model, config).run([prompt[:64]])   # warm-up: kernels, rotary table
    times, token = [], None
    rss_before = _status_mb("VmRSS")
    with PeakMemory(torch.device("cpu")) as peak:
        for _ in range(args.repeats):
            gen = Generator(loaded.model, config)
            out = gen.run([prompt])
            times.append(out.prefill_s)
            token = out.sequences[0][0]
            cache_bytes, resolved = gen.cache.nbytes, gen.plan.to_dict()
            del gen
    print(json.dumps({"q_chunk": args.q_chunk or None, "window": args.window or None, "peak_rss_mb": peak.rss_mb,
                      "peak_scope": peak.scope, "rss_before_mb": rss_before, "prefill_s": times,
                      "first_token": token, "cache_bytes": cache_bytes, "plan": resolved}))


def timing(args: argparse.Namespace, configs: list[tuple[int, int]]) -> dict:
    """Prefill time of every configuration, alternating within each round in this one process
    (ratios less exposed to other load on the machine than the subprocesses' times)."""
    import warnings

    import torch

    from caramba.infer import GenerateConfig, Generator
    from caramba.evaluation.evaluate import corpus_ids
    from caramba.model.zoo import load_model

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "float32", "cpu", progress=False)
    ids = corpus_ids(loaded.tokenizer)
    prompt = (ids * (args.prompt // len(ids) + 1))[: args.prompt]
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    for r in range(args.time_rounds + 1):   # round 0 is a warm-up
        for q_chunk, window in configs:
            plan = {} if not q_chunk and not window else {
                "decode_plan": "fixed", "decode_q_chunk": q_chunk or None, "decode_local_window": window or None}
            config = GenerateConfig(max_new_tokens=1, temperature=0.0, eos_token_id=None, max_seq_len=args.prompt + 1, **plan)
            t = Generator(loaded.model, config).run([prompt]).prefill_s
            if r:
                times[(q_chunk, window)].append(t)
        print(f"timing round {r} done", file=sys.stderr)
    base = statistics.median(times[(0, 0)])
    return {c: {"prefill_s": statistics.median(ts), "vs_unchunked": statistics.median(ts) / base, "samples": ts}
            for c, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--chunks", default="256,512,1024", help="q_chunk values to compare with unchunked")
    ap.add_argument("--window", type=int, default=512, help="also a window+ring run (0: skip)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="prefills per subprocess")
    ap.add_argument("--threads", type=int, default=torch_threads_default())
    ap.add_argument("--time-rounds", type=int, default=3, help="in-process alternating timing rounds (0: skip)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--q-chunk", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-window", dest="child_window", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.window = args.child_window
        child(args)
        return

    configs = [(0, 0)] + [(int(c), 0) for c in args.chunks.split(",") if c.strip()]
    if args.window:
        configs.append((args.window, args.window))   # window W, ring of W + W slots, chunks of W
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for q_chunk, window in configs:
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--prompt", str(args.prompt),
                   "--repeats", str(args.repeats), "--threads", str(args.threads), "--q-chunk", str(q_chunk),
                   "--child-window", str(window)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs[(q_chunk, window)].append(json.loads(line))
            print(f"round {r}: q_chunk={q_chunk or '-'} window={window or '-'} done", file=sys.stderr)

    timed = timing(args, configs) if args.time_rounds else {}
    base = statistics.median(x["peak_rss_mb"] for x in runs[(0, 0)])
    base_token = runs[(0, 0)][0]["first_token"]
    rows = []
    for (q_chunk, window), xs in runs.items():
        peak = statistics.median(x["peak_rss_mb"] for x in xs)
        added = statistics.median(x["peak_rss_mb"] - x["rss_before_mb"] for x in xs)
        rows.append({"q_chunk": q_chunk or None, "window": window or None, "peak_rss_mb": peak,
                     "prefill_added_mb": added, "peak_vs_unchunked": peak / base,
                     "prefill_s": statistics.median(t for x in xs for t in x["prefill_s"]),
                     "prefill_s_alternating": timed.get((q_chunk, window), {}).get("prefill_s"),
                     "time_vs_unchunked": timed.get((q_chunk, window), {}).get("vs_unchunked"),
                     "cache_mb": xs[0]["cache_bytes"] / 2**20, "same_first_token": xs[0]["first_token"] == base_token,
                     "plan": xs[0]["plan"]})
    env = {"torch_threads": args.threads, "load_average": os.getloadavg(), "cpu": platform.processor() or platform.machine(),
           "prompt_tokens": args.prompt, "rounds": args.rounds, "repeats": args.repeats,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"prefill of {args.prompt} tokens, SmolLM2-135M fp32, {args.threads} threads, load average {env['load_average']}")
    print(f"{'q_chunk':>8} {'window':>7} {'peak RSS MB':>12} {'added MB':>9} {'vs none':>8} {'prefill s':>10} "
          f"{'alt. s':>7} {'time vs none':>12} {'cache MB':>9} same-token")
    for row in rows:
        alt, ratio = row["prefill_s_alternating"], row["time_vs_unchunked"]
        print(f"{row['q_chunk'] or '-':>8} {row['window'] or '-':>7} {row['peak_rss_mb']:>12.0f} {row['prefill_added_mb']:>9.0f} "
              f"{row['peak_vs_unchunked']:>8.2f} {row['prefill_s']:>10.2f} {alt or float('nan'):>7.2f} "
              f"{ratio or float('nan'):>12.2f} {row['cache_mb']:>9.1f} {row['same_first_token']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows, "raw": {f"{k[0]}/{k[1]}": v for k, v in runs.items()},
                       "timing": {f"{k[0]}/{k[1]}": v for k, v in timed.items()}}, f, indent=1)


def torch_threads_default() -> int:
    return min(os.cpu_count() or 1, 2)


if __name__ == "__main__":
    main()
