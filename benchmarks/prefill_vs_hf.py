"""Time to the first token: caramba's prefill vs HF transformers' on SmolLM2-135M, fp32, batch 1.

For each prompt length N, the time from N prompt tokens to the first new token, through each
library's own generation entry point with its KV cache:
- caramba: Generator(max_new_tokens=1).run (the cache allocated, the prompt fed, one token picked);
- HF generate: hf.generate(max_new_tokens=1) (its prefill passes logits_to_keep=1);
- HF forward: hf(ids, use_cache=True, logits_to_keep=1) and an argmax, the leanest HF path.
Both load the same GGUF independently. Calls alternate in one process (caramba, HF generate,
HF forward, caramba, ...) after a warm-up of each, and medians are reported with the ratio
HF / caramba (> 1: caramba is faster). Prompt ids are drawn at random from the vocabulary with
seed N, the same prompt at every thread count (a prefill's time does not depend on which tokens),
and the first tokens are checked to agree. --onednn-ab adds caramba with its oneDNN GEMM off
(caramba.gemm: torch's GEMM and SDPA, as before 2026-11-27) to the alternation. Threads:
CARAMBA_THREADS pins caramba's count, torch.set_num_threads HF's, to the same N.

    .venv/bin/python benchmarks/prefill_vs_hf.py [--tokens 2048,4096] [--threads 1,2] [--repeats 5]
        [--onednn-ab] [--profile out_prefix] [--json out.json]

--profile writes torch.profiler tables (ops by self CPU time, with input shapes) of one prefill
of each library at each length and thread count, instead of timing.
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
from caramba import gemm  # noqa: E402
from caramba.model.zoo import load_model, resolve_source  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def caramba_first(model, ids: list[int]):
    def go() -> int:
        gen = Generator(model, GenerateConfig(max_new_tokens=1, temperature=0.0, max_seq_len=len(ids) + 1))
        return gen.run([ids]).sequences[0][0]
    return go


def without_onednn(fn):
    """fn with caramba's projections on torch's own GEMM (caramba.gemm off): the before."""
    def go() -> int:
        saved, gemm._available = gemm._available, False
        try:
            return fn()
        finally:
            gemm._available = saved
    return go


def hf_generate_first(hf, ids: list[int]):
    x = torch.tensor([ids])

    def go() -> int:
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False,
                              use_cache=True, pad_token_id=0)
        return int(out[0, -1])
    return go


def hf_forward_first(hf, ids: list[int]):
    x = torch.tensor([ids])

    def go() -> int:
        with torch.inference_mode():
            out = hf(x, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())
    return go


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    tok = fn()
    return time.perf_counter() - t0, tok


def measure(runners: dict, repeats: int) -> dict:
    firsts = {name: fn() for name, fn in runners.items()}   # warm-up, and the first tokens to compare
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):   # alternate, so drift on a shared machine hits every runner alike
        for name, fn in runners.items():
            t, tok = timed(fn)
            assert tok == firsts[name], f"{name}: first token changed between runs"
            samples[name].append(t)
    med = {name: statistics.median(s) for name, s in samples.items()}
    return {"median_s": med, "samples_s": samples, "first_tokens": firsts,
            "ratio_hf_generate_over_caramba": med["hf_generate"] / med["caramba"],
            "ratio_hf_forward_over_caramba": med["hf_forward"] / med["caramba"],
            **({"ratio_hf_generate_over_caramba_torch_gemm": med["hf_generate"] / med["caramba_torch_gemm"]}
               if "caramba_torch_gemm" in med else {})}


def profile(runners: dict, prefix: str, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for name, fn in runners.items():
        fn()
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40)
        plain = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        path = f"{prefix}_{label}_{name}.txt"
        with open(path, "w") as f:
            f.write(plain + "\n\n" + table + "\n")
        print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="thread counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", help="write profiler tables with this path prefix instead of timing")
    ap.add_argument("--onednn-ab", action="store_true",
                    help="also time caramba with oneDNN's GEMM off (caramba_torch_gemm: torch's F.linear/matmul)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2-135m", "float32", "cpu")
    path = resolve_source("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    vocab = loaded.model.config.vocab_size
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        os.environ["CARAMBA_THREADS"] = str(threads)
        for n in (int(t) for t in args.tokens.split(",")):
            ids = torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            runners = {"caramba": caramba_first(loaded.model, ids), "hf_generate": hf_generate_first(hf, ids),
                       "hf_forward": hf_forward_first(hf, ids)}
            if args.onednn_ab:
                runners["caramba_torch_gemm"] = without_onednn(runners["caramba"])
            if args.profile:
                profile(runners, args.profile, f"{n}tok_{threads}thr")
                continue
            load_before = os.getloadavg()
            r = measure(runners, args.repeats)
            r.update(tokens=n, threads=threads, loadavg_before=load_before, loadavg_after=os.getloadavg())
            results.append(r)
            med = r["median_s"]
            print(f"{n:5d} tokens, {threads} thread(s): caramba {med['caramba']:.3f} s  HF generate "
                  f"{med['hf_generate']:.3f} s  HF forward {med['hf_forward']:.3f} s  ratio HF/caramba "
                  f"{r['ratio_hf_generate_over_caramba']:.3f} (generate) {r['ratio_hf_forward_over_caramba']:.3f}"
                  f" (forward)" + (f"; caramba without oneDNN {med['caramba_torch_gemm']:.3f} s"
                                   if args.onednn_ab else "")
                  + f"; first tokens {r['first_tokens']}; load {load_before} -> {os.getloadavg()}",
                  flush=True)
    if args.json and results:
        env = {"torch": torch.__version__, "cpu": cpu_name(), "cores": os.cpu_count(), "repeats": args.repeats}
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
