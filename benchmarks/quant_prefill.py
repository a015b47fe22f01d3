"""Prefill tok/s of SmolLM2-135M (or --model) with quantized weights against fp32 weights, in one run.

Issue 31 goal 4: a prompt's prefill with q8_0, q4_0 or native (Q4_1) weights at least as fast as
with fp32 weights. Each format's model is loaded once; every repeat prefills the same prompt
(caramba's corpus, repeated to --tokens) through each format in turn (fp32, q8_0, q4_0, native,
...), so a busy machine slows them alike; one warm-up prefill per format first. Reported: median
wall-clock tok/s, median tok/s of process CPU time (all threads: what a descheduled thread does
not spend, steadier on a shared machine), and each median's ratio to fp32's in the same run;
the CPU's model name, threads, load average before and after, and the GEMM level
(caramba.model.quant_gemm) the quantized prefill ran at.

--old adds each quantized format through the path before the int8 GEMM (the GEMM's level set
to scalar, so QuantLinear dequantizes and calls torch), in the same alternation.

--llamacpp adds llama.cpp's prompt processing of the same weights (`llama-bench -p T -n 0`, one
repetition per turn, the same threads) after each caramba prefill of that format: F32 beside
fp32, Q8_0 beside q8_0, Q4_0 beside q4_0, Q4_1 beside native (benchmarks/llamacpp.py builds it
once; never in CI). Its column is llama.cpp's tok/s and caramba's ratio to it.

native@Q4_K_M (or @Q5_K_M, @Q6_K, @FILE: the --model file as it is) runs caramba's `native` on the
K-quant file llama-quantize makes from the F32 GGUF, beside llama.cpp on the same file (--llamacpp).

    .venv/bin/python benchmarks/quant_prefill.py [--tokens 512,2048] [--threads 1] [--repeats 3]
        [--formats fp32,q8_0,q4_0,native] [--old] [--llamacpp [--sdist FILE] [--llamacpp-isa avx2]]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import llamacpp  # noqa: E402
from caramba.evaluation.evaluate import corpus_ids  # noqa: E402
from caramba.model import isa, quant, quant_gemm  # noqa: E402
from caramba.model.zoo import load_model, resolve_source  # noqa: E402


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llama_format(kind: str) -> str:
    """llama.cpp's weights beside caramba's `kind`: its format, or for "native@Q4_K_M" that file."""
    weights, _, file = kind.partition("@")
    return file or llamacpp.LLAMA_FORMAT[weights]


@torch.inference_mode()
def prefill(model, prompt: torch.Tensor) -> tuple[float, float]:
    """(wall tok/s, CPU tok/s) of one prefill of `prompt` [1, T] into a fresh cache."""
    cache = model.new_cache(1, prompt.shape[1] + 1)
    t0, c0 = time.perf_counter(), time.process_time()
    model(prompt, cache=cache, last_only=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return prompt.shape[1] / wall, prompt.shape[1] / cpu


def llama_prefill(tools, model: Path, tokens: int, threads: int) -> float:
    """tok/s of one `llama-bench -p tokens -n 0` run (prompt processing only; one repetition)."""
    command = [str(tools.exe("llama-bench")), "-m", str(model), "-p", str(tokens), "-n", "0", "-t", str(threads),
               "-r", "1", "-o", "json"]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"llama-bench failed (exit {run.returncode}): {run.stderr.strip()[-2000:]}")
    return float(json.loads(run.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,2048", help="comma-separated prompt lengths")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m", help="a zoo name (smollm2-135m, gemma3-270m) or a .gguf file")
    ap.add_argument("--formats", default=None, help="default fp32,q8_0,q4_0,native (another --model: fp32,q8_0)")
    ap.add_argument("--old", action="store_true", help="also time the quantized formats' torch path")
    ap.add_argument("--llamacpp", action="store_true", help="also time llama-bench -p T on the same weights")
    ap.add_argument("--sdist", default=None, help="llama_cpp_python-*.tar.gz (default: newest in /tmp/lcp)")
    ap.add_argument("--llamacpp-isa", default="native", choices=list(llamacpp.ISA_FLAGS),
                    help="llama.cpp's build (benchmarks/llamacpp.py): native, or avx2 (with CARAMBA_ISA=avx2: "
                    "both sides as an AVX2-only CPU runs them)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    default_model = args.model == "smollm2-135m"
    args.formats = args.formats or ("fp32,q8_0,q4_0,native" if default_model else "fp32,q8_0")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    files = (*llamacpp.KQUANT_FILES, llamacpp.FILE)
    bad = [f for f in formats if f.partition("@")[0] not in quant.WEIGHT_KINDS or f.partition("@")[2] not in ("", *files)]
    if bad or "fp32" not in formats:
        ap.error(f"--formats: need fp32 and kinds of {', '.join(quant.WEIGHT_KINDS)}, each optionally @ a file of "
                 f"{', '.join(files)} (got {args.formats})")
    if not args.llamacpp and any("@" in f for f in formats):
        ap.error("--formats: kind@FILE runs need --llamacpp (llama-quantize makes the file)")
    lengths = [int(t) for t in args.tokens.split(",")]
    torch.set_num_threads(args.threads)

    tools = (llamacpp.build(["llama-bench", "llama-quantize"], args.sdist, isa=args.llamacpp_isa)
             if args.llamacpp else None)
    source = None if default_model else resolve_source(args.model)
    ggufs = llamacpp.models(tools, sorted({llama_format(w) for w in formats}), source) if tools else {}
    models = {w: load_model(str(ggufs[w.partition("@")[2]]) if "@" in w else args.model, progress=False,
                            weights=w.partition("@")[0]) for w in formats}
    ids = corpus_ids(models["fp32"].tokenizer)
    variants = [(w, False) for w in formats] + [(w, True) for w in formats if args.old and w != "fp32"]
    name = {v: v[0] + (" (torch path)" if v[1] else "") for v in variants}
    load_before = os.getloadavg()
    results = {}
    for T in lengths:
        prompt = torch.tensor([(ids * (T // len(ids) + 1))[:T]])
        runs = {v: [] for v in variants}
        llama = {w: [] for w in formats if tools}
        for r in range(args.repeats + 1):            # round 0: warm-up, not counted
            for v in variants:
                w, old = v
                if old:
                    with quant_gemm.use_level("scalar"):
                        got = prefill(models[w].model, prompt)
                else:
                    got = prefill(models[w].model, prompt)
                if r:
                    runs[v].append(got)
                if tools and not old:
                    tok_s = llama_prefill(tools, ggufs[llama_format(w)], T, args.threads)
                    if r:
                        llama[w].append(tok_s)
        results[T] = (runs, llama)
    load_after = os.getloadavg()

    print(f"\nprefill of {args.model}, {cpu_model()}, {args.threads} thread(s), torch {torch.__version__}; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; int8 GEMM at "
          f"{quant_gemm.level()}, decode products at {isa.kernel_isa()}; medians of {args.repeats}"
          + (f"; llama.cpp build {args.llamacpp_isa}" if tools else ""))
    extra = " llama.cpp tok/s | caramba / llama.cpp |" if tools else ""
    print("| tokens | weights | tok/s (wall) | vs fp32 | tok/s (CPU time) | vs fp32 |" + extra)
    print("|---|---|---|---|---|---|" + ("---|---|" if tools else ""))
    table = []
    for T, (runs, llama) in results.items():
        base = [statistics.median(x[i] for x in runs[("fp32", False)]) for i in (0, 1)]
        for v, xs in runs.items():
            med = [statistics.median(x[i] for x in xs) for i in (0, 1)]
            row = {"tokens": T, "weights": v[0], "torch_path": v[1], "wall_tok_s": [x[0] for x in xs],
                   "cpu_tok_s": [x[1] for x in xs], "median_wall": med[0], "median_cpu": med[1],
                   "ratio_wall": med[0] / base[0], "ratio_cpu": med[1] / base[1]}
            cells = ""
            if tools:
                if v[1]:
                    cells = " | |"
                else:
                    lm = statistics.median(llama[v[0]])
                    row.update(llamacpp_tok_s=llama[v[0]], llamacpp_format=llama_format(v[0]),
                               ratio_llamacpp=med[0] / lm)
                    cells = f" {lm:.0f} ({llama_format(v[0])}) | {med[0] / lm:.2f}x |"
            print(f"| {T} | {name[v]} | {med[0]:.0f} | {med[0] / base[0]:.2f}x | {med[1]:.0f} | {med[1] / base[1]:.2f}x |"
                  + cells)
            table.append(row)
    if args.json:
        record = {"cpu": cpu_model(), "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
                  "loadavg_before": load_before, "loadavg_after": load_after, "gemm_level": quant_gemm.level(),
                  "llamacpp_isa": args.llamacpp_isa if args.llamacpp else None,
                  "kernel_isa": isa.kernel_isa(), "rows": table, "command": sys.argv}
        fd, tmp = tempfile.mkstemp(dir=args.json.parent or ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, args.json)   # atomic


if __name__ == "__main__":
    main()
