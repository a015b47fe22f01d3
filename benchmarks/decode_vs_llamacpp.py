"""Batch-1 decode tok/s of caramba and llama.cpp on SmolLM2-135M (or --model), per weight format, in one run.

The anchor of issue 15: llama.cpp's `llama-bench` (tg: tokens generated one at a time after an
empty prompt) on the same weights, against caramba's decode step (greedy, one token, fp32 KV
cache) timed the same way: --tokens steps after a short prompt. Formats, as pairs:

    F32   caramba weights=fp32    llama.cpp F32 GGUF   (the embedded Q4_1 file dequantized: same values)
    Q8_0  caramba weights=q8_0    llama.cpp Q8_0 GGUF  (llama-quantize --allow-requantize from the Q4_1 file)
    Q4_0  caramba weights=q4_0    llama.cpp Q4_0 GGUF  (the same; both keep the tied head at 8 bits)
    Q4_1  caramba weights=native  llama.cpp Q4_1 GGUF  (the file as shipped)
    Q4_1  caramba weights=native_i16  (the same blocks, activations rounded to int16: not exact)

caramba's q8_0 and q4_0 requantize the same dequantized values as llama-quantize does (with
searched block scales: caramba.model.quant). Runs alternate
(caramba F32, llama.cpp F32, caramba Q8_0, ...) in every repeat, so a busy machine slows both
sides alike; the table gives medians, with the load average before and after.

--model gemma3-270m (or any .gguf) times another model: llama.cpp requantizes that file to F32 and
Q8_0 (--allow-requantize, as for SmolLM2) and caramba loads it with weights fp32 / q8_0.

K-quant files as model pages offer them: --formats Q4_K_M,Q6_K (or Q5_K_M) has llama-quantize make
each from the F32 GGUF, and caramba runs that same file with weights native (its blocks as stored)
and native_i16 (the same blocks, activations rounded to int16 codes: llama.cpp rounds them to 8 bits);
--formats FILE runs the --model file as it is on both sides (Gemma 3 270M's Q4_K_M as shipped).

    .venv/bin/python benchmarks/decode_vs_llamacpp.py [--model smollm2-135m] [--threads 2] [--tokens 64] [--repeats 5]
        [--formats F32,Q8_0,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K,FILE] [--sdist FILE] [--no-llamacpp] [--torch-path] [--isa LEVELS]
        [--rows] [--cpu-time] [--llamacpp-isa native|avx2] [--json out.json]

--isa avx2,avx512vnni times caramba's quantized products at each of these instruction set levels
(caramba.model.isa; each level the machine lacks falls back, and the table says to what), in the
same alternation: an A/B of the kernels on one machine. The first level fills the ratio column.

--rows adds caramba with its quantized weights in the row-major layout (caramba.model.quant's
layout 'rows': the kernels before the row-interleaved x16 ones) in the same alternation: the A/B of
the x16 kernels (--isa lowers the level, which on x16 weights runs their portable reference).

--llamacpp-isa avx2 times a llama.cpp built without AVX-512 or VNNI (benchmarks/llamacpp.py's
ISA_FLAGS, its own build directory). With CARAMBA_ISA=avx2 in the environment (caramba's weights
laid out and multiplied at that level from the start), both sides run what an AVX2-only CPU would:
a stand-in, on a CPU that has more, for one such as AMD Zen 3 when none is at hand.

--torch-path adds caramba with its one-call decode step off (the torch backend,
caramba.model.backend.TorchStep, instead of fast_decode.CStep), the torch-op path every step took
before it, in the same alternation.

llama.cpp is built by benchmarks/llamacpp.py (from the llama-cpp-python sdist, cached under
~/.cache/caramba/llama.cpp/<version>/; targets llama-bench and llama-quantize). It is a
benchmark, never a test: CI never builds llama.cpp.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import llamacpp  # noqa: E402  (benchmarks/llamacpp.py)
from caramba.cache import kernel as cache_kernel  # noqa: E402
from caramba import fused  # noqa: E402
from caramba.model import fast_decode, isa, quant  # noqa: E402
from caramba.model.backend import Backend, TorchStep, choose  # noqa: E402
from caramba.model.zoo import load_model, resolve_source  # noqa: E402

def llama_bench(tools: llamacpp.Tools, model: Path, tokens: int, threads: int) -> tuple[float, list[str]]:
    """tok/s of one llama-bench tg run (one repetition: we repeat and alternate ourselves)."""
    command = [str(tools.exe("llama-bench")), "-m", str(model), "-p", "0", "-n", str(tokens), "-t", str(threads),
               "-r", "1", "-o", "json"]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"llama-bench failed (exit {run.returncode}): {run.stderr.strip()[-2000:]}")
    rows = json.loads(run.stdout)
    return float(rows[0]["avg_ts"]), command


CPU_TOK_S: list[float] = []   # caramba_decode's tokens per second of this process's CPU time, run by run


@torch.inference_mode()
def caramba_decode(step: Backend, prompt: torch.Tensor, tokens: int) -> float:
    """tok/s of `tokens` greedy single-token decode steps after the prompt's prefill, through the
    backend `step` (wall clock; per CPU second, all threads, appended to CPU_TOK_S: what a
    descheduled thread does not spend, so an A/B of kernels survives a busy machine better)."""
    cache = step.model.new_cache(1, prompt.shape[1] + tokens + 1)
    tok = step(prompt, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        tok = step(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
    CPU_TOK_S.append(tokens / (time.process_time() - c0))
    return tokens / (time.perf_counter() - t0)


def caramba_kinds(fmt: str) -> list[str]:
    """The caramba runs timed against llama.cpp's `fmt`: weight kinds of the model, or for a K-quant
    file, "native Q4_K_M": that file itself with weights native."""
    if fmt in (*llamacpp.KQUANT_FILES, llamacpp.FILE):
        return [f"native {fmt}", f"native_i16 {fmt}"]
    return llamacpp.CARAMBA_WEIGHTS[fmt]


def load_kind(kind: str, model: str, ggufs: dict[str, Path]):
    weights, _, fmt = kind.partition(" ")
    return load_model(str(ggufs[fmt]) if fmt else model, progress=False, weights=weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per measurement (llama-bench -n)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m",
                    help="a zoo name (smollm2-135m, gemma3-270m) or a .gguf file; formats other than the default "
                         "model's are requantized from it (default formats then: F32,Q8_0)")
    ap.add_argument("--formats", default=None, help="default F32,Q8_0,Q4_0,Q4_1 (another --model: F32,Q8_0)")
    ap.add_argument("--sdist", default=None, help="llama_cpp_python-*.tar.gz (default: newest in /tmp/lcp)")
    ap.add_argument("--no-llamacpp", action="store_true", help="caramba only (no llama.cpp build or runs)")
    ap.add_argument("--llamacpp-isa", default="native", choices=list(llamacpp.ISA_FLAGS),
                    help="llama.cpp's build: native, or avx2 (no AVX-512 nor VNNI: with CARAMBA_ISA=avx2 in the "
                    "environment, both sides run what an AVX2-only CPU would)")
    ap.add_argument("--torch-path", action="store_true",
                    help="also time caramba with its one-call decode step off (model.fast_decode = False)")
    ap.add_argument("--isa", default=None, help="comma-separated instruction set levels to time caramba at "
                    f"({', '.join(isa.LEVELS)}; default: the one chosen)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="also give caramba's tokens per CPU second (process time, all threads) per level")
    ap.add_argument("--rows", action="store_true",
                    help="also time caramba with row-major quantized weights (the kernels before the x16 layout)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    default_model = args.model == "smollm2-135m"
    formats = [f.strip() for f in (args.formats or ("F32,Q8_0,Q4_0,Q4_1" if default_model else "F32,Q8_0")).split(",")
               if f.strip()]
    known = [*llamacpp.CARAMBA_WEIGHTS, *llamacpp.KQUANT_FILES, llamacpp.FILE]
    unknown = [f for f in formats if f not in known]
    if unknown:
        ap.error(f"--formats: unknown {', '.join(unknown)}; use {', '.join(known)}")
    if args.no_llamacpp and any(f in (*llamacpp.KQUANT_FILES, llamacpp.FILE) for f in formats):
        ap.error("--formats: K-quant and FILE runs need llama.cpp (its llama-quantize, the file's path); "
                 "drop --no-llamacpp")
    torch.set_num_threads(args.threads)
    levels = [v.strip() for v in args.isa.split(",")] if args.isa else [None]
    bad = [v for v in levels if v is not None and v not in isa.LEVELS]
    if bad:
        ap.error(f"--isa: unknown {', '.join(bad)}; use {', '.join(isa.LEVELS)}")

    tools = None if args.no_llamacpp else llamacpp.build(["llama-bench", "llama-quantize"], args.sdist,
                                                                isa=args.llamacpp_isa)
    source = None if default_model else resolve_source(args.model)
    ggufs = {} if tools is None else llamacpp.models(tools, formats, source)
    kinds = [w for f in formats for w in caramba_kinds(f)]
    models = {w: load_kind(w, args.model, ggufs) for w in kinds}
    rows_models = {}
    if args.rows:   # the same weights held row-major (fp32 has none to relayout)
        for w in kinds:
            m = copy.deepcopy(models[w].model)
            if quant.relayout(m, "rows"):
                rows_models[w] = m
    layouts = sorted({q.layout for lm in models.values() for q in lm.model.modules() if isinstance(q, quant.QuantLinear)})
    tokenizer = next(iter(models.values())).tokenizer
    prompt = torch.tensor([tokenizer.encode("The history of the lighthouse begins with")])
    steps = {w: choose(models[w].model) for w in kinds}            # the C step where it applies, as a Generator's
    torch_steps = {w: TorchStep(models[w].model) for w in kinds}
    rows_steps = {w: choose(m) for w, m in rows_models.items()}

    load_before = os.getloadavg()
    rows = {w: {"caramba": [], "torch path": [], "rows": [], "rows cpu": [], "cpu": [],
                **{f"isa {v}": [] for v in levels if v}} for w in kinds}
    llama_runs = {f: [] for f in formats}
    commands = {}
    for w in kinds:   # warm-up: kernel builds, first-touch of the weights
        caramba_decode(steps[w], prompt, 4)
        if w in rows_steps:
            caramba_decode(rows_steps[w], prompt, 4)
    for _ in range(args.repeats):
        for f in formats:
            for w in caramba_kinds(f):
                for v in levels:
                    if v is None:
                        rows[w]["caramba"].append(caramba_decode(steps[w], prompt, args.tokens))
                        rows[w]["cpu"].append(CPU_TOK_S[-1])
                        continue
                    with isa.use_isa(v):
                        rows[w][f"isa {v}"].append(caramba_decode(steps[w], prompt, args.tokens))
                        rows[w].setdefault(f"cpu {v}", []).append(CPU_TOK_S[-1])
                if levels[0] is not None:
                    rows[w]["caramba"] = rows[w][f"isa {levels[0]}"]
                if w in rows_steps:
                    rows[w]["rows"].append(caramba_decode(rows_steps[w], prompt, args.tokens))
                    rows[w]["rows cpu"].append(CPU_TOK_S[-1])
                if args.torch_path:
                    rows[w]["torch path"].append(caramba_decode(torch_steps[w], prompt, args.tokens))
            if tools is not None:
                ts, commands[f] = llama_bench(tools, ggufs[f], args.tokens, args.threads)
                llama_runs[f].append(ts)
    load_after = os.getloadavg()

    print(f"{args.model} batch-1 decode, {args.tokens} tokens x {args.repeats} alternating repeats, "
          f"{args.threads} threads, torch {torch.__version__}, {platform.processor() or platform.machine()}; "
          f"kernels: decode step {fast_decode.status()}, weights {quant.status()}, decode ops {fused.status()}, "
          f"kv {cache_kernel.status()}, quantized products at {isa.kernel_isa()} (caramba.model.isa), "
          f"weight layout {'/'.join(layouts) or '-'}; llama.cpp build {args.llamacpp_isa}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} (on {os.cpu_count()} CPUs)")
    chosen = {v: isa.resolve(v) for v in levels if v}   # what each level ran at (a fallback where it is missing)
    extra = " caramba, torch path tok/s |" if args.torch_path else ""
    extra += "".join(f" caramba at {v}{'' if chosen[v] == v else f' (ran {chosen[v]})'} tok/s |" for v in levels[1:] if v)
    cpu_levels = [v for v in levels if v] if args.cpu_time else []
    extra += "".join(f" caramba at {v}, tok per CPU s |" for v in cpu_levels)
    if args.cpu_time and levels == [None]:
        extra += " caramba, tok per CPU s |"
    if args.rows:
        extra += " caramba rows layout tok/s |" + (" rows layout, tok per CPU s |" if args.cpu_time else "")
    first = "" if levels[0] is None else f" at {levels[0]}" + ("" if chosen[levels[0]] == levels[0] else f" (ran {chosen[levels[0]]})")
    print(f"| format | caramba weights | caramba{first} tok/s | llama.cpp tok/s | caramba / llama.cpp |{extra}")
    print("|---|---|---|---|---|" + "---|" * extra.count("|"))
    table = []
    for f in formats:
        lc = statistics.median(llama_runs[f]) if llama_runs[f] else None
        for w in caramba_kinds(f):
            c = statistics.median(rows[w]["caramba"])
            ratio = f"{c / lc:.2f}x" if lc else "-"
            tp = f" {statistics.median(rows[w]['torch path']):.1f} |" if args.torch_path else ""
            tp += "".join(f" {statistics.median(rows[w][f'isa {v}']):.1f} |" for v in levels[1:] if v)
            tp += "".join(f" {statistics.median(rows[w][f'cpu {v}']):.1f} |" for v in cpu_levels)
            med = lambda k: f" {statistics.median(rows[w][k]):.1f} |" if rows[w][k] else " - |"  # noqa: E731
            if args.cpu_time and levels == [None]:
                tp += med("cpu")
            if args.rows:
                tp += med("rows") + (med("rows cpu") if args.cpu_time else "")
            print(f"| {f} | {w} | {c:.1f} | {f'{lc:.1f}' if lc else '-'} | {ratio} |{tp}")
            choice = getattr(steps[w], "threads", None)   # the C step's adaptive thread count
            if choice is not None and choice.current not in (None, args.threads):
                print(f"  note: caramba's {w} step settled on {choice.current} thread(s) (fast_decode.ThreadChoice: "
                      "two measured slower on this machine just then)")
            table.append({"format": f, "caramba_weights": w, "caramba_tok_s": c, "llamacpp_tok_s": lc,
                          "caramba_runs": rows[w]["caramba"], "llamacpp_runs": llama_runs[f],
                          "torch_path_runs": rows[w]["torch path"], "decode_step": steps[w].path,
                          "isa_runs": {v: rows[w][f"isa {v}"] for v in levels if v},
                          "isa_cpu_tok_s": {v: rows[w].get(f"cpu {v}", []) for v in levels if v},
                          "cpu_tok_s": rows[w]["cpu"], "rows_layout_runs": rows[w]["rows"],
                          "rows_layout_cpu_tok_s": rows[w]["rows cpu"]})
    if args.json:
        Path(args.json).write_text(json.dumps({
            "threads": args.threads, "tokens": args.tokens, "repeats": args.repeats, "torch": torch.__version__,
            "loadavg_before": load_before, "loadavg_after": load_after, "kernels": quant.status(),
            "decode_step": fast_decode.status(), "kernel_isa": isa.kernel_isa(), "isa_levels": chosen,
            "weight_layouts": layouts, "llamacpp_isa": args.llamacpp_isa,
            "llamacpp_commands": commands, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
