"""The C kernels' layout (issue 45), as ggml keeps its CPU kernels: the portable references in their
own files, one file per architecture family, the dispatch and the exported functions in another;
no file over 900 lines; every C file in a library's sources (each library is one compiler command
over its files: caramba.kernels), sharing with the others through its header, never by #including
a .c. Read from the sources, nothing built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from caramba.cache import kernel as cache_kernel
from caramba import fused
from caramba.model import fast_decode, quant, quant_gemm

PACKAGE = Path(__file__).resolve().parents[1] / "caramba"
SOURCES = sorted(PACKAGE.rglob("*.c")) + sorted(PACKAGE.rglob("*.h"))
LIBRARIES = {"quant_gemv": quant.SOURCES, "decode_step": fast_decode.SOURCES, "quant_gemm": quant_gemm.SOURCES,
             "quant_attend": cache_kernel.SOURCES, "decode_ops": [fused.SOURCE]}
MAX_LINES = 900
# x86 intrinsics and vector types; AArch64's (NEON types, v*_s8 .. v*_f32 intrinsics)
X86 = re.compile(r"\b_mm(256|512)?_\w+|\b__m(128|256|512)[id]?\b|\b__mmask\d+\b")
ARM = re.compile(r"\b(u?int|float)(8|16|32|64)x\d+(x\d)?_t\b|\bv\w+_[suf](8|16|32|64)\b")
# the files that must be portable C (what every build runs: the references and the dispatch), and
# each architecture family's own
PORTABLE = ("model/quant_gemv.c", "model/quant_gemv_ref.c", "model/quant_gemv_ref.h", "model/quant_gemv_kq.h",
            "model/quant_gemv_kq_ref.c", "cache/quant_attend.c", "cache/quant_attend_ref.c", "cache/quant_attend_ref.h")
FAMILY = {"model/quant_gemv_x86.c": X86, "model/quant_gemv_x86_x16.c": X86, "model/quant_gemv_kq_x86.c": X86,
          "model/quant_gemv_arm.c": ARM, "model/quant_gemv_kq_arm.c": ARM}


def code(path: Path) -> str:
    """The file without its comments (a comment may name an intrinsic)."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(), flags=re.S)


def test_the_sources_are_found():
    names = {p.relative_to(PACKAGE).as_posix() for p in SOURCES}
    assert set(PORTABLE) | set(FAMILY) <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_c_file_is_over_900_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name}: {lines} lines; split it (a reference, an architecture, the dispatch)"


def test_every_c_file_is_compiled_into_a_library():
    listed = {Path(s).resolve() for sources in LIBRARIES.values() for s in sources}
    assert {p.resolve() for p in PACKAGE.rglob("*.c")} == listed


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_files_include_headers_only_and_those_exist(path):
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
        assert name.endswith(".h"), f"{path.name} includes {name}: share through a header"
        assert (path.parent / name).exists(), f"{path.name} includes {name}, which does not exist"


@pytest.mark.parametrize("name", PORTABLE)
def test_the_references_and_the_dispatch_are_portable_c(name):
    text = code(PACKAGE / name)
    assert not X86.search(text) and not ARM.search(text), (X86.search(text) or ARM.search(text)).group(0)


@pytest.mark.parametrize("name", FAMILY)
def test_an_architecture_file_holds_its_own_family_only(name):
    text, own = code(PACKAGE / name), FAMILY[name]
    other = ARM if own is X86 else X86
    assert own.search(text) and not other.search(text), other.search(text)
