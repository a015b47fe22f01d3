"""A loaded model's weights moved into one private anonymous mapping, with 2 MiB pages asked for.

A batch-1 decode step reads every weight once per token, as fast as one core's memory bandwidth
allows, so where the weights lie counts. A loader leaves them in file-backed memory (an fp32
checkpoint's tensors are views of the safetensors file's memory map: page-cache pages, 4 KiB
each) or in malloc's blocks (a quantized model's codes: 4 KiB pages too, transparent huge pages
being "madvise" on most distributions). On the AMD EPYC Zen 5 (a KVM guest) the fp32 decode step
ran 12% faster from a private anonymous mapping with MADV_HUGEPAGE than from the file's pages
(docs/decode-speed-log.md §11): a hardware prefetcher stops at every 4 KiB page, and a TLB miss in a
guest walks two page tables.

`place(module)` copies every CPU parameter and buffer into one such mapping, storage by storage
(tensors that share a storage, a tied matrix's views, keep sharing it) and points the tensors at
it. It is called once, by caramba.model.zoo.load_model, before anything holds the weights'
addresses (the C step's plans read data_ptr()). `CARAMBA_WEIGHT_ARENA=0` leaves the weights
where the loader put them (the A/B switch).
"""

from __future__ import annotations

import mmap
import os
from itertools import chain

import torch
from torch import nn

ENV = "CARAMBA_WEIGHT_ARENA"
ALIGN = 4096   # each storage's copy starts on a page (and keeps its bytes' alignment mod 64)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [lo, hi) of t's storage that t reads."""
    es = t.element_size()
    lo = t.storage_offset() * es
    return lo, lo + es * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))


def place(module: nn.Module) -> int:
    """Move `module`'s CPU parameters and buffers into one anonymous mapping (huge pages asked for
    where the OS has them). Returns the mapping's bytes: 0 when switched off or nothing moved."""
    if not enabled():
        return 0
    seen: set[int] = set()
    tensors = []
    for t in chain(module.parameters(), module.buffers()):
        if t is not None and id(t) not in seen and t.device.type == "cpu" and t.numel() > 0:
            seen.add(id(t))
            tensors.append(t)
    storages: dict[int, list[torch.Tensor]] = {}   # by the storage's address: tied views stay tied
    for t in tensors:
        storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    plan, total = [], 0
    for group in storages.values():
        lo = min(_span(t)[0] for t in group) // 64 * 64
        hi = max(_span(t)[1] for t in group)
        plan.append((group, lo, hi, total))
        total += (hi - lo + ALIGN - 1) // ALIGN * ALIGN
    if total == 0:
        return 0
    buf = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:   # a kernel without transparent huge pages: 4 KiB pages, still anonymous
            pass
    arena = torch.frombuffer(buf, dtype=torch.uint8)   # the tensors keep `buf` alive
    storage = arena.untyped_storage()
    for group, lo, hi, at in plan:
        src = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())
        arena[at:at + hi - lo].copy_(src[lo:hi])
        for t in group:
            es = t.element_size()
            moved = torch.empty(0, dtype=t.dtype).set_(storage, (at + t.storage_offset() * es - lo) // es,
                                                        t.shape, t.stride())
            t.data = moved
    return total
