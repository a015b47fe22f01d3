"""Decode and prefill with one core busy with another process (issue 31, goal 3).

    .venv/bin/python benchmarks/contention.py [--weights fp32] [--repeats 3] [--new-tokens 32]
        [--prompt-tokens 600] [--modes 1,2,auto] [--spincounts caramba] [--no-llamacpp] [--json FILE]

Each thread mode runs through the Generator as a user's generation does: `1` and `2` are
CARAMBA_THREADS=1 / =2 (forced), `auto` is the default (caramba.threads picks from the cores free
when the generation starts, the C step's ThreadChoice adapts from there). Each is timed quiet and
with a process spinning on the last CPU (caramba.bench.busy), in alternating order, `--repeats`
rounds; medians are printed, with the ratio to the 1-thread median of the same worker in the same
state, busy or not (the goal: `auto` with one core busy >= 0.9x of that, decode and prefill alike).

`--spincounts` runs one worker process per OpenMP wait bound (libgomp reads GOMP_SPINCOUNT once,
when it loads): `caramba` (caramba's default, caramba.threads.SPINCOUNT), `libgomp` (libgomp's own
default, 300000), or a number; the workers take turns within each round. When llama.cpp's
llama-bench is already built (benchmarks/llamacpp.py; never built here), its tg and pp at -t 1 and
-t 2 on the F32 GGUF run in the same rounds. The CPU model and load average are recorded; on a
machine shared with other jobs the figures are noisy, and the quiet rows are only as quiet as the
machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LIBGOMP_DEFAULT = "300000"


# ---- the worker: one process, one OpenMP wait bound, the model loaded once ----------------------

def worker(args) -> None:
    import caramba  # noqa: F401  (sets the wait bound before torch loads libgomp)
    import torch

    from caramba import threads
    from caramba.infer.generate import Generator
    from caramba.model.zoo import load_model

    threads.REUSE_S = 0.0     # every generation samples: the busy process comes and goes between them
    lm = load_model("smollm2-135m", progress=False, weights=args.weights)
    text = (ROOT / "caramba" / "data" / "corpus.txt").read_text()
    long_ids = lm.tokenizer.encode(text)[: args.prompt_tokens]
    short_ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a time")
    if len(long_ids) < args.prompt_tokens:
        raise SystemExit(f"corpus.txt has {len(long_ids)} tokens, fewer than --prompt-tokens {args.prompt_tokens}")

    def measure(mode: str) -> dict:
        if mode == "auto":
            os.environ.pop("CARAMBA_THREADS", None)
        else:
            os.environ["CARAMBA_THREADS"] = mode
        gen = Generator(lm.model, _config(args.new_tokens))    # its C step's thread choice fresh, as a new process's
        decode = gen.run([short_ids])
        choice = gen.threads.as_record()
        pre = Generator(lm.model, _config(1)).run([long_ids])
        return {"decode_tok_s": decode.decode_tok_s, "prefill_s": pre.prefill_s, "threads_used": choice["used"],
                "why": choice["why"], "step_threads": getattr(gen.backend, "threads", None) and gen.backend.threads.current}

    with torch.inference_mode():
        measure("1")     # warm-up: kernels built and loaded, caches touched
        print(json.dumps({"ready": True, "wait": threads.bound_spinning(), "torch_threads": torch.get_num_threads()}),
              flush=True)
        for line in sys.stdin:
            print(json.dumps(measure(line.strip())), flush=True)


def _config(tokens: int):
    from caramba.infer.config import GenerateConfig

    return GenerateConfig(max_new_tokens=tokens, min_new_tokens=tokens, temperature=0.0)


# ---- the parent: alternation, the busy process, llama-bench, the summary ------------------------

class Worker:
    def __init__(self, spin: str, args) -> None:
        env = dict(os.environ)
        env.pop("CARAMBA_THREADS", None)
        env.pop("OMP_WAIT_POLICY", None)
        env.pop("GOMP_SPINCOUNT", None)
        if spin != "caramba":
            env["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT if spin == "libgomp" else spin
        command = [sys.executable, __file__, "--worker", "--weights", args.weights, "--new-tokens",
                   str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens)]
        self.spin = spin
        self.proc = subprocess.Popen(command, env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker (spincount {self.spin}) exited with {self.proc.wait()}")
        return json.loads(line)

    def measure(self, mode: str) -> dict:
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def llama_bench(exe: Path, model: Path, threads: int, tokens: int, prompt: int) -> dict:
    """tg tok/s and pp seconds of one llama-bench repetition each."""
    out = {}
    for key, flags in (("decode_tok_s", ["-p", "0", "-n", str(tokens)]), ("prefill_s", ["-p", str(prompt), "-n", "0"])):
        run = subprocess.run([str(exe), "-m", str(model), *flags, "-t", str(threads), "-r", "1", "-o", "json"],
                             capture_output=True, text=True, timeout=600)
        if run.returncode:
            raise RuntimeError(f"llama-bench failed (exit {run.returncode}): {run.stderr.strip()[-1000:]}")
        tps = json.loads(run.stdout)[0]["avg_ts"]
        out[key] = tps if key == "decode_tok_s" else prompt / tps
    return out


def find_llama_bench():
    """(llama-bench, F32 GGUF) when both are already at hand, else None: nothing is built here."""
    from benchmarks import llamacpp

    for root in sorted(llamacpp.cache_root().glob("*")):
        exe = root / "build" / "bin" / "llama-bench"
        f32 = root / "models" / (llamacpp.embedded_gguf().stem + ".F32.gguf")
        if exe.exists():
            if not f32.exists() and (root / "build" / "bin" / "llama-quantize").exists():
                f32 = llamacpp.f32_model(llamacpp.Tools(root, root / "src", root / "build" / "bin"))
            if f32.exists():
                return exe, f32
    return None


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--modes", default="1,2,auto")
    ap.add_argument("--spincounts", default="caramba", help="comma list: caramba, libgomp or a number")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from caramba.bench.busy import busy_core

    modes = args.modes.split(",")
    llama = None if args.no_llamacpp else find_llama_bench()
    print(f"CPU {cpu_model()}, {len(os.sched_getaffinity(0))} CPUs, load average {os.getloadavg()}, "
          f"weights {args.weights}, llama-bench {'at ' + str(llama[0]) if llama else 'not used'}", flush=True)
    workers = [Worker(s, args) for s in args.spincounts.split(",")]
    rows: list[dict] = []
    load = [os.getloadavg()]
    try:
        for r in range(args.repeats):
            for busy in ((False, True) if r % 2 == 0 else (True, False)):
                with _maybe_busy(busy, busy_core):
                    order = modes if r % 2 == 0 else modes[::-1]
                    for w in workers:
                        for mode in order:
                            m = w.measure(mode)
                            rows.append({"impl": "caramba", "spin": w.spin, "mode": mode, "busy": busy, "round": r, **m})
                            print(json.dumps(rows[-1]), flush=True)
                    for t in (1, 2) if llama else ():
                        m = llama_bench(*llama, t, args.new_tokens, args.prompt_tokens)
                        rows.append({"impl": "llama.cpp", "spin": "-", "mode": str(t), "busy": busy, "round": r, **m})
                        print(json.dumps(rows[-1]), flush=True)
            load.append(os.getloadavg())
    finally:
        for w in workers:
            w.close()
    summary(rows, workers, load)
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps({"cpu": cpu_model(), "load_average": load, "args": vars(args),
                                   "workers": {w.spin: w.hello for w in workers}, "rows": rows}, indent=1))
        os.replace(tmp, args.json)


def _maybe_busy(busy: bool, busy_core):
    from contextlib import nullcontext

    return busy_core(seconds=3600) if busy else nullcontext()


def summary(rows: list[dict], workers: list[Worker], load: list) -> None:
    """Medians per (impl, spin, mode, busy), with the ratio to the 1-thread median of the same impl,
    spin and busy state (the goal's reference: one thread on the machine as it is)."""
    print(f"\nload average per round: {[tuple(round(v, 2) for v in avg) for avg in load]}")
    print("impl       spin     mode  busy  decode tok/s (x 1 thread)  prefill s (x 1 thread)  threads used")
    for impl, spin in sorted({(x["impl"], x["spin"]) for x in rows}):
        mine = [x for x in rows if x["impl"] == impl and x["spin"] == spin]

        def med(key, mode, busy):
            vals = [x[key] for x in mine if x["mode"] == mode and x["busy"] == busy]
            return statistics.median(vals) if vals else float("nan")
        for busy in (False, True):
            base_d, base_p = med("decode_tok_s", "1", busy), med("prefill_s", "1", busy)
            for mode in dict.fromkeys(x["mode"] for x in mine):
                d, p = med("decode_tok_s", mode, busy), med("prefill_s", mode, busy)
                used = sorted({x.get("threads_used") for x in mine if x["mode"] == mode and x["busy"] == busy} - {None})
                print(f"{impl:10} {spin:8} {mode:5} {'yes' if busy else 'no':5} {d:8.1f} ({d / base_d:4.2f}x)"
                      f"             {p:6.2f} ({base_p / p:4.2f}x)          {used or '-'}")


if __name__ == "__main__":
    main()
