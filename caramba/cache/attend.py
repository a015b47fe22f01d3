"""Attention that reads a quantized cache where it lies, chunk by chunk.

A decode step's query attends over the whole prefix. Dequantizing the prefix into a fresh
full-precision tensor every step would write and read back 4 bytes per element where the cache
holds 1 or half a byte, plus a multiply per element by its scale. Here the codes of `chunk`
tokens at a time are only converted to floats (small enough to stay in the CPU cache) and the
block scales are folded into the (much smaller) score and probability rows instead:

    q . k   = sum_j s_j * (q_j . c_j)        (j: the blocks of one head, s_j its scale)
    p @ V   = sum_n (p_n * s_nj) * c_nj      (per block j of the value vector)

Both sums over blocks come out of one matmul by giving the query (or the probabilities) one
row per block: row (g, j) holds only block j, and the rows are recombined afterwards. A uniform
kind's code offset (q8_0: c + 1/2, q4_0: u - 7.5) folds the same way: q . (u + o) = q . u + o * sum(q).
What a code stands for is read from the kind's spec (caramba.cache.kinds). Zero-point,
per-channel and 2-bit kinds (`spec.reads_dequantized`) go to the C kernels' zero-point loops
(key_scores_zp / value_mix_zp) or, where those do not apply, are read by dequantizing each chunk
and one matmul.

That is the eager path. On the CPU with fp32 queries the coded pieces go to the C kernels
instead (caramba.cache.kernel; kinds whose spec names a kernel), which apply the same sums
without converting any code to a stored float; the pieces, the mask and the softmax stay here
for both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from caramba.cache import kernel
from caramba.cache.kinds import KindSpec

READ_CHUNK = 2048  # tokens per converted chunk; see benchmarks/cache_kinds.py

# One reusable buffer per (dtype, device) for the converted codes of a chunk. A fresh multi-MB
# tensor per layer and step costs more in page faults than the conversion itself.
_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    key = (dtype, device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a plain tensor: writable in and out of inference mode
            buf = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def _pieces(stream, end: int, chunk: int) -> list[tuple[int, int, bool]]:
    """(s0, s1, from_codes) pieces covering [0, end): code chunks, then the full-precision window."""
    r0 = stream.fp_start(end) if stream.quantized else 0
    pieces, s = [], 0
    while s < r0:  # a remainder of up to chunk/4 joins the last chunk instead of costing a pass
        s1 = r0 if r0 - s <= chunk + chunk // 4 else s + chunk
        pieces.append((s, s1, True))
        s = s1
    if r0 < end:
        pieces.append((r0, end, False))
    return pieces


def _float_values(stream, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, n, D] from a float stream or a quantized stream's full-precision window."""
    return stream.residual(s0, s1, dtype) if stream.quantized else stream.data[:, :, s0:s1].to(dtype)


def _code_values(codes: torch.Tensor, spec: KindSpec, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """Codes -> (values, offset): each element is scale * (value + offset) (caramba.cache.quant)."""
    if spec.packed:
        shape = list(codes.shape)
        shape[dim] *= 2
        u = _scratch(tuple(shape), torch.uint8, codes.device)
        lo, hi = u.chunk(2, dim)
        torch.bitwise_and(codes, 0x0F, out=lo)
        torch.bitwise_right_shift(codes, 4, out=hi)
    else:
        u = codes
    if spec.levels is not None:
        return spec.levels.to(device=codes.device, dtype=dtype)[u.long()], 0.0
    return _scratch(tuple(u.shape), dtype, codes.device).copy_(u), spec.offset


def _per_block_rows(x: torch.Tensor, nb: int) -> torch.Tensor:
    """[B, H, R, D] -> [B, H, R * nb, D]: row (r, j) keeps only block j of row r."""
    B, H, R, D = x.shape
    if nb == 1:
        return x
    eye = torch.eye(nb, dtype=x.dtype, device=x.device)[:, :, None]          # [nb, nb, 1]
    return (x.view(B, H, R, 1, nb, D // nb) * eye).reshape(B, H, R * nb, D)


def _key_scores(qx: torch.Tensor, stream, s0: int, s1: int) -> torch.Tensor:
    """qx [B, KVH, R * nb, D] (per-block rows) against codes [s0, s1) -> scores [B, KVH, R, n]."""
    codes, scales = stream.code_slice(s0, s1)                  # [B, KVH, Dc, n], [B, KVH, nb, n]
    values, offset = _code_values(codes, stream.spec, -2, qx.dtype)   # [B, KVH, D, n]
    part = qx @ values                                         # [B, KVH, R * nb, n]
    if offset:
        part += offset * qx.sum(-1, keepdim=True)
    B, H, Rnb, n = part.shape
    return (part.view(B, H, Rnb // stream.nb, stream.nb, n) * scales[:, :, None].to(qx.dtype)).sum(3)


def _value_mix(p: torch.Tensor, stream, s0: int, s1: int) -> torch.Tensor:
    """p [B, KVH, R, n] over value codes [s0, s1) -> [B, KVH, R, D]."""
    codes, scales = stream.code_slice(s0, s1)                  # [B, KVH, n, Dc], [B, KVH, nb, n]
    values, offset = _code_values(codes, stream.spec, -1, p.dtype)     # [B, KVH, n, D]
    B, H, R, n = p.shape
    nb, D = stream.nb, values.shape[-1]
    pw = (p[:, :, :, None, :] * scales[:, :, None].to(p.dtype)).view(B, H, R * nb, n)
    mixed = pw @ values                                        # [B, KVH, R * nb, D]
    if offset:
        mixed += offset * pw.sum(-1, keepdim=True)
    # Row (r, j) weighted every block by block j's scales: keep its block j only.
    return mixed.view(B, H, R, nb, nb, D // nb).diagonal(dim1=3, dim2=4).transpose(-1, -2).reshape(B, H, R, D)


def attend_chunked(q: torch.Tensor, k_stream, v_stream, end: int, mask: torch.Tensor | None,
                   chunk: int | None = None) -> torch.Tensor:
    """q [B, H, T, D] over cached slots [0, end) -> [B, H, T, Dv] (scaled by D^-1/2)."""
    return attend_pairs([(q, k_stream)], v_stream, end, mask, q.shape[-1] ** -0.5, chunk)


def attend_pairs(pairs: Sequence[tuple[torch.Tensor, object]], v_stream, end: int, mask: torch.Tensor | None,
                 scale: float, chunk: int | None = None) -> torch.Tensor:
    """softmax(scale * sum_i q_i . k_i) @ V over cached slots [0, end) -> [B, H, T, Dv].

    pairs: (q_i [B, H, T, D_i], key stream i) whose scores add up before the one softmax: one
    pair for standard attention, (semantic, geometric) for decoupled attention. mask:
    [B, 1, T, end] bool (True = attend) or None (every slot). Grouped-query heads share their
    KV head without copying it: each q is viewed [B, KVH, G*T, D_i].
    """
    chunk = chunk or READ_CHUNK
    q0, v0 = pairs[0][0], v_stream
    B, H, T, _ = q0.shape
    KVH = v0.n_heads
    G = H // KVH
    scores = None
    for q, k_stream in pairs:
        part = _stream_scores(q.reshape(B, KVH, G * T, q.shape[-1]) * scale, k_stream, end, chunk)
        scores = part if scores is None else scores.add_(part)        # [B, KVH, G*T, end]
    if mask is not None:
        scores = scores.view(B, KVH, G, T, end).masked_fill(~mask[:, :, None], float("-inf")).view(B, KVH, G * T, end)
    p = torch.softmax(scores.float(), dim=-1).to(q0.dtype)
    fused = v_stream.quantized and v_stream.spec.kernel is not None and kernel.usable(p)
    fused_zp = (v_stream.quantized and not v_stream.spec.per_channel and kernel.reads_zero_point(v_stream)
                and kernel.usable(p))
    out = None
    for s0, s1, coded in _pieces(v_stream, end, end if fused or fused_zp else chunk):
        ps = p[..., s0:s1]
        if coded and fused:
            part = kernel.value_mix(ps, *v_stream.code_slice(s0, s1), v_stream.spec, v_stream.block, v_stream.head_dim)
        elif coded and fused_zp:
            part = kernel.value_mix_zp(ps, *v_stream.code_slice(s0, s1), v_stream.spec, v_stream.block,
                                       v_stream.head_dim)
        elif coded and v_stream.spec.reads_dequantized:
            part = ps @ v_stream.dequant(s0, s1, q0.dtype)
        else:
            part = _value_mix(ps, v_stream, s0, s1) if coded else ps @ _float_values(v_stream, s0, s1, q0.dtype)
        out = part if out is None else out.add_(part)
    return out.view(B, KVH, G, T, -1).reshape(B, H, T, -1)


def _stream_scores(qg: torch.Tensor, k_stream, end: int, chunk: int) -> torch.Tensor:
    """Scaled queries qg [B, KVH, R, D] against one key stream's slots [0, end) -> [B, KVH, R, end]."""
    fused = k_stream.quantized and k_stream.spec.kernel is not None and kernel.usable(qg)
    fused_zp = k_stream.quantized and kernel.reads_zero_point(k_stream) and kernel.usable(qg)
    qx = _per_block_rows(qg, k_stream.nb) if k_stream.quantized and not fused \
        and not k_stream.spec.reads_dequantized else None
    parts = []
    for s0, s1, coded in _pieces(k_stream, end, end if fused or fused_zp else chunk):
        if coded and fused:
            parts.append(kernel.key_scores(qg, *k_stream.code_slice(s0, s1), k_stream.spec, k_stream.block))
        elif coded and fused_zp:
            group = k_stream.G if k_stream.spec.per_channel else 0
            parts.append(kernel.key_scores_zp(qg, *k_stream.code_slice(s0, s1), k_stream.spec, k_stream.block, group))
        elif coded and k_stream.spec.reads_dequantized:
            parts.append(qg @ k_stream.dequant(s0, s1, qg.dtype).transpose(-1, -2))
        elif coded:
            parts.append(_key_scores(qx, k_stream, s0, s1))
        else:
            parts.append(qg @ _float_values(k_stream, s0, s1, qg.dtype).transpose(-1, -2))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
