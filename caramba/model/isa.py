"""Which instruction set the quantized weight products run with (cpu_isa.c), for records and tests.

The C libraries that multiply block-quantized weights (quant_gemv.c's, and decode_step.c's which
is built with it), and quant_attend.c's (attention over quantized KV caches: its portable
reference at scalar, its vector loops at every other level), each choose a level once, when they
load: the best the CPU, the OS and the build all have, or the one CARAMBA_ISA asks for (a level
the machine lacks falls back to the best one below it in its family, never above). Levels,
slowest first: scalar (the portable reference), then x86-64's avx2, avxvnni, avx512, avx512vnni,
or ARM's neon (AArch64: sdot where the build has the dot-product extension). A level of one family
is never chosen on the other's machines: a wish for it runs at scalar. Every vector level's
outputs are bit-identical to avx2's (neon's row-major products too: tests/model/test_cross_arm.py);
scalar differs by fp32 summation order only (quant_attend.c's: by where multiply-adds fuse).
Quantized layers made at a level with a vector kernel for their format hold their codes
row-interleaved (caramba.model.quant's layout 'x16': every format at avx512vnni, the q8
activations' at avx2, avxvnni and avx512); at any other level x16 layers run the portable
reference, bit-identical and slow (for tests; an A/B of kernels compares layouts: quant.relayout,
benchmarks/decode_vs_llamacpp.py --rows). In the decode step's library, scalar (and neon, which
has no fp32 kernels of its own) runs the fp32 products, value mixing and dot products through
their portable references (step_linear.c's and decode_step.c's *_ref).

    kernel_isa()           the level the products run with ('avx512vnni'), or why no C kernels run
    available('avx2')      whether this machine (CPU, OS, build) has a level
    resolve('avx512')      the level a wish for one runs at here (itself or the best below it)
    with use_isa('avx2'):  run the products at a lower level for a while (tests, A/B timings)
    amx()                  AMX tiles usable: the CPU has them and the OS let this process use them
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Iterator

from caramba.cache import kernel as cache_kernel
from caramba.model import fast_decode, quant

LEVELS = ("scalar", "avx2", "avxvnni", "avx512", "avx512vnni", "neon")   # cpu_isa.h's order
ARM_LEVELS = ("neon",)   # ARM's family; the others above scalar are x86-64's
ENV = "CARAMBA_ISA"
_warned = False


def _libraries() -> list:
    """The libraries that carry cpu_isa.c, loaded (quant_gemv's first: it is what kernel_isa names)."""
    return [lib for lib in (quant.library(), fast_decode.library(), cache_kernel.library()) if lib is not None]


def _check_env(lib) -> None:
    global _warned
    if lib.isa_env_error() and not _warned:
        _warned = True
        warnings.warn(f"{ENV}={os.environ.get(ENV)!r} is not an instruction set level; use one of "
                      f"{', '.join(LEVELS)} (running at {lib.isa_name().decode()})", stacklevel=3)


def kernel_isa() -> str:
    """The level the quantized products run at, or 'eager (<why>)' where no C kernels load."""
    libs = _libraries()
    if not libs:
        return f"eager ({quant.status()})"
    _check_env(libs[0])
    return libs[0].isa_name().decode()


def available(level: str) -> bool:
    """Whether this CPU, its OS and the kernel build all have `level` (False without kernels)."""
    _check_level(level)
    lib = quant.library()
    return bool(lib and lib.isa_available(level.encode()))


def resolve(level: str) -> str:
    """The level a wish for `level` runs at here: itself, or the best level below it in its family
    available (cpu_isa.c's isa_pick)."""
    _check_level(level)
    family = [name for name in LEVELS[: LEVELS.index(level) + 1]
              if name == "scalar" or (name in ARM_LEVELS) == (level in ARM_LEVELS)]
    return next(name for name in reversed(family) if name == "scalar" or available(name))


def amx() -> bool:
    """AMX tiles usable here (asks the OS's leave once: arch_prctl(ARCH_REQ_XCOMP_PERM))."""
    lib = quant.library()
    return bool(lib and lib.isa_amx())


def _check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"instruction set level {level!r} is not one of {', '.join(LEVELS)}")


@contextmanager
def use_isa(level: str) -> Iterator[str]:
    """Run the products at `level` (or the best level below it the machine has) inside the block;
    yields the level in force. Not while a product runs on another thread."""
    _check_level(level)
    libs = _libraries()
    before = [lib.isa_name() for lib in libs]
    try:
        for lib in libs:
            lib.isa_set(level.encode())
        yield libs[0].isa_name().decode() if libs else f"eager ({quant.status()})"
    finally:
        for lib, name in zip(libs, before):
            lib.isa_set(name)
