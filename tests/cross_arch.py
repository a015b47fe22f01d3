"""caramba's C kernel libraries built for aarch64 and called under qemu-aarch64 (tests/model/test_cross_arm.py).

Each library is compiled with the cross compiler from the same sources and flags caramba.kernels
uses, except the target: -march=native names this (x86) machine, so the ARM build asks for
ARMv8.2-A with the dot-product extension, a Neoverse-N1 / Graviton2-class CPU (or, `target=
PLAIN_TARGET`, ARMv8.0-A without it: a Cortex-A72 / Raspberry Pi 4-class one). The emulator runs
its `max` CPU (every feature it knows, dotprod included) unless `cpu` names another. The library is
driven by tests/cross_call.c, run under the emulator, which makes the calls a test sends it; a
buffer argument travels there and back, so a call reads like a ctypes one:

    compile_library([...sources...], path); lib = ArmLibrary.load(path)
    lib.call("block_sums", kind, w, a, n, out)      # numpy arrays as buffers: `out` is filled

Where the cross compiler or the emulator is missing, `missing()` names the package to install.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np

from caramba import kernels

CC = "aarch64-linux-gnu-gcc"
EMULATOR = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"    # Debian's arm64 cross libraries (libc, libgomp)
TARGET = ["-march=armv8.2-a+dotprod"]
PLAIN_TARGET = ["-march=armv8-a"]
# caramba.kernels' flags with the target swapped for the one above
FLAGS = [f for f in kernels.FLAGS if not f.startswith("-march")] + TARGET
DRIVER = Path(__file__).with_name("cross_call.c")


def missing() -> str | None:
    """Why the ARM build cannot run here (the tools to install), or None."""
    need = []
    if shutil.which(CC) is None:
        need.append(f"{CC} (apt install gcc-aarch64-linux-gnu libgomp1-arm64-cross)")
    if shutil.which(EMULATOR) is None:
        need.append(f"{EMULATOR} (apt install qemu-user)")
    if not need and not Path(SYSROOT, "lib", "libgomp.so.1").exists():
        need.append("the arm64 OpenMP runtime (apt install libgomp1-arm64-cross)")
    return "no " + " and no ".join(need) if need else None


def compile_library(sources: list[Path], out: Path, target: list[str] = TARGET) -> subprocess.CompletedProcess:
    """The aarch64 shared library of `sources`, compiled as caramba.kernels compiles it for
    `target`; the compiler's output is returned for the warnings."""
    flags = [f for f in FLAGS if f not in TARGET] + target
    return subprocess.run([CC, *flags, "-Wall", *map(str, sources), *kernels.LIBS, "-o", str(out)], capture_output=True,
                          text=True, timeout=600)


class ArmLibrary:
    """One library under the emulator: `call(name, *args, ret="i")` with int and numpy-array arguments."""

    def __init__(self, library: Path, driver: Path, cpu: str | None = None, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen([EMULATOR, *(["-cpu", cpu] if cpu else []), "-L", SYSROOT, str(driver),
                                         str(library)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=env)

    @classmethod
    def load(cls, library: Path, cpu: str | None = None, env: dict[str, str] | None = None) -> ArmLibrary:
        """The library (built by compile_library) driven by cross_call.c, built beside it, on the
        emulator's CPU `cpu` (None: its default, `max`) with the environment `env` (None: ours)."""
        driver = library.with_name("cross_call")
        if not driver.exists():
            subprocess.run([CC, "-O1", "-std=c11", "-D_GNU_SOURCE", str(DRIVER), "-ldl", "-o", str(driver)],
                           check=True, capture_output=True, text=True)
        return cls(library, driver, cpu, env)

    def call(self, name: str, *args, ret: str = "i"):
        """The function's result (an int, a str for ret="s", None for "v"); array arguments are
        written back in place with what the call left in them."""
        message = [struct.pack("<I", len(name)), name.encode(), struct.pack("<I", len(args))]
        buffers = []     # (array to fill or None for bytes, length), in argument order
        for a in args:
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError(f"{name}: buffer arguments must be C-contiguous")
                message += [b"b", struct.pack("<Q", a.nbytes), a.tobytes()]
                buffers.append((a, a.nbytes))
            elif isinstance(a, bytes):
                message += [b"b", struct.pack("<Q", len(a)), a]
                buffers.append((None, len(a)))
            else:
                message += [b"i", struct.pack("<q", int(a))]
        message.append(ret.encode())
        self.process.stdin.write(b"".join(message))
        self.process.stdin.flush()
        if ret == "s":
            result = self._read(self._read_struct("<I")).decode()
        else:
            result = self._read_struct("<q")
        for a, n in buffers:
            data = self._read(n)
            if a is not None:
                a[...] = np.frombuffer(data, a.dtype).reshape(a.shape)
        return None if ret == "v" else result

    def _read_struct(self, fmt: str) -> int:
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _read(self, n: int) -> bytes:
        data = self.process.stdout.read(n)
        if len(data) != n:
            self.process.kill()
            raise RuntimeError(f"the emulated library stopped: {self.process.stderr.read().decode()}")
        return data

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
