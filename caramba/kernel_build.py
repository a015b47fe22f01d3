"""The C kernel libraries and the instruction-set variants each is built in: one definition, read by
setup.py (which builds every library x variant into caramba/_kernels when the package is installed)
and by caramba.kernels (which loads the best prebuilt variant for this CPU, else compiles at run time).

Standard library only and no caramba imports: setup.py loads this file by path, before caramba's
dependencies (torch) are installed.

The C sources gate each instruction set at compile time (__AVX2__/__FMA__/__F16C__,
__AVXVNNI__, __AVX512F__/BW/VL/VNNI, __AMX_*__) and dispatch at run time among the levels compiled
in (model/cpu_isa.c; CARAMBA_ISA caps it), so a variant is a set of -march flags that turns a
level's macros on, and the CPU flags (/proc/cpuinfo) a CPU needs to run it.
"""

from __future__ import annotations

import hashlib
import platform
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent   # caramba/
PREBUILT_DIR = "_kernels"                   # caramba/_kernels/<lib>-<variant>-<hash>.so

# flags every build shares; the run-time build adds -march=native, a variant its own -march
COMMON_FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# after the sources: the kernels call libm (lrintf, expf), which x86-64 inlines and aarch64 does
# not; inside Python libm happens to be loaded already, but a library must name what it needs
LIBS = ["-lm"]

# library name (its first source's stem) -> its sources, relative to caramba/; the Library(...)
# call sites take their SOURCES from here (sources()).
_QUANT_GEMV = ["model/quant_gemv.c", "model/quant_gemv_ref.c", "model/quant_gemv_x86.c",
               "model/quant_gemv_x86_x16.c", "model/quant_gemv_arm.c", "model/quant_gemv_kq_ref.c",
               "model/quant_gemv_kq_x86.c", "model/quant_gemv_kq_arm.c", "model/cpu_isa.c"]
LIBRARIES: dict[str, list[str]] = {
    "quant_gemv": _QUANT_GEMV,
    "decode_step": ["model/decode_step.c", "model/attend_sums.c", "model/step_linear.c", "model/kv_stream.c",
                    "model/decode_ops.c", *_QUANT_GEMV],
    "decode_ops": ["model/decode_ops.c"],
    "quant_gemm": ["model/quant_gemm.c", "model/quant_gemm_i16.c", "model/cpu_isa.c"],
    "quant_attend": ["cache/quant_attend.c", "cache/quant_attend_ref.c", "cache/quant_attend_vec.c",
                     "model/kv_stream.c", "model/cpu_isa.c"],
}


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]        # the -march flags
    needs: frozenset[str]         # the /proc/cpuinfo flags a CPU must have to run it


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
# lowest first: the loader takes the last one a CPU can run
VARIANTS: dict[str, list[Variant]] = {
    "x86_64": [
        Variant("x86-64-v2", ("-march=x86-64-v2",), frozenset({"sse4_2", "popcnt", "ssse3"})),
        Variant("avx2", ("-march=x86-64-v3",), _V3),
        Variant("avxvnni", ("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"}),
        Variant("avx512", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
                _V4 | {"avx512_vnni", "avx512_bf16"}),
        Variant("amx", ("-march=sapphirerapids",),
                _V4 | {"avx_vnni", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}),
    ],
    "aarch64": [
        Variant("armv8", ("-march=armv8-a",), frozenset({"asimd"})),
        Variant("armv8.2-dotprod", ("-march=armv8.2-a+dotprod+fp16",), frozenset({"asimd", "asimddp", "asimdhp"})),
    ],
}


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def cpu_features(cpuinfo: str | None = None) -> set[str]:
    """This CPU's feature flags: /proc/cpuinfo's "flags" line on x86-64, "Features" on AArch64;
    on macOS sysctl's, in Linux's names (darwin_features). Empty where neither answers: then no
    prebuilt variant is chosen, and caramba compiles at run time."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return darwin_features(_sysctl()) if platform.system() == "Darwin" else set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


# sysctl's names (lower case) for the flags VARIANTS need, where Linux names them otherwise
_DARWIN_X86 = {"avx1.0": "avx", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx512vnni": "avx512_vnni",
               "avx512bf16": "avx512_bf16", "avxvnni": "avx_vnni"}
_DARWIN_ARM = {"hw.optional.advsimd": "asimd", "hw.optional.neon": "asimd", "hw.optional.arm.feat_dotprod": "asimddp",
               "hw.optional.arm.feat_fp16": "asimdhp", "hw.optional.neon_fp16": "asimdhp"}


def darwin_features(sysctl: str) -> set[str]:
    """Linux's flag names from `sysctl machdep.cpu hw.optional` output: an Intel Mac lists its CPUID
    features upper-case in machdep.cpu.features / leaf7_features (AVX1.0, SSE4.2, AVX512VNNI); an
    Apple Silicon Mac sets hw.optional.* to 1 (AdvSIMD, arm.FEAT_DotProd, arm.FEAT_FP16)."""
    flags: set[str] = set()
    for line in sysctl.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key in ("machdep.cpu.features", "machdep.cpu.leaf7_features", "machdep.cpu.extfeatures"):
            flags |= {_DARWIN_X86.get(f, f) for f in value.lower().split()}
        elif key in _DARWIN_ARM and value == "1":
            flags.add(_DARWIN_ARM[key])
    return flags


def _sysctl() -> str:
    try:
        return subprocess.run(["sysctl", "machdep.cpu", "hw.optional"], capture_output=True, text=True,
                              timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def variants(arch: str | None = None) -> list[Variant]:
    return VARIANTS.get(arch or machine(), [])


def choose(cpu: set[str] | frozenset[str], available: list[str], arch: str | None = None) -> Variant | None:
    """The highest variant among `available` (names) that a CPU with flags `cpu` can run, else None."""
    best = None
    for v in variants(arch):
        if v.name in available and v.needs <= cpu:
            best = v
    return best


def source_bytes(source: Path, seen: frozenset = frozenset()) -> bytes:
    """The source and, recursively, the files it #includes "like_this.h" (paths relative to it): a
    library is rebuilt when any of them changes."""
    text = source.read_bytes()
    parts = [text]
    for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', text, re.M):
        included = (source.parent / name.decode()).resolve()
        if included.exists() and included not in seen:
            parts.append(source_bytes(included, seen | {source.resolve()}))
    return b"".join(parts)


def source_hash(sources: list[Path]) -> str:
    """What a prebuilt library's file name carries: the hash of its sources and their headers, and of
    the shared flags (a library built from other sources or flags is stale)."""
    return hashlib.sha256(b"".join(source_bytes(s) for s in sources) + " ".join(COMMON_FLAGS + LIBS).encode()
                          ).hexdigest()[:16]


def sources(name: str, package: Path = PACKAGE) -> list[Path]:
    return [package / s for s in LIBRARIES[name]]


def prebuilt_name(name: str, variant: str, digest: str) -> str:
    return f"{name}-{variant}-{digest}.so"


def compile_variant(cc: str, name: str, variant: Variant, out_dir: Path, package: Path = PACKAGE) -> Path:
    """Build library `name` in `variant` into out_dir: its sources compiled (compile_object) and
    linked (link_variant) in a scratch folder (raises CalledProcessError with the compiler's stderr)."""
    with tempfile.TemporaryDirectory(prefix="caramba-kernels-") as scratch:
        objects = [compile_object(cc, s, variant, Path(scratch), package) for s in sources(name, package)]
        return link_variant(cc, name, variant, objects, out_dir, package)


def compile_object(cc: str, source: Path, variant: Variant, obj_dir: Path, package: Path = PACKAGE) -> Path:
    """One source file in `variant` as an object under obj_dir (raises CalledProcessError with the
    compiler's stderr). A library is its sources compiled one by one and linked (what one `cc` over
    all of them does), so a file two libraries share (quant_gemv's, in decode_step) compiles once."""
    obj = obj_dir / variant.name / source.relative_to(package).with_suffix(".o")
    obj.parent.mkdir(parents=True, exist_ok=True)
    flags = [f for f in COMMON_FLAGS if f != "-shared"]
    subprocess.run([cc, *flags, *variant.flags, "-c", str(source), "-o", str(obj)], check=True, capture_output=True,
                   text=True, timeout=1200)
    return obj


def link_variant(cc: str, name: str, variant: Variant, objects: list[Path], out_dir: Path,
                 package: Path = PACKAGE) -> Path:
    """Library `name` in `variant` from its sources' objects (compile_object), into out_dir."""
    out = out_dir / prebuilt_name(name, variant.name, source_hash(sources(name, package)))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    subprocess.run([cc, "-shared", "-fopenmp", *map(str, objects), *LIBS, "-o", str(tmp)], check=True,
                   capture_output=True, text=True, timeout=600)
    tmp.replace(out)
    return out
