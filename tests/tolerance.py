"""Tolerances for comparing two computations that agree up to floating-point rounding.

Two ways of computing the same values (a one-token decode step against a whole-prompt forward,
chunked against unchunked, batched against one-row matmuls, caramba against transformers) differ
only in the order of their sums and in where values are rounded to a narrower dtype. Which order
a CPU takes varies by machine (GEMV vs GEMM kernels, SIMD width, threads), so a tolerance must
bound the rounding error, not record what one machine happened to produce:

    |got - expected| <= SLACK * eps(dtype) * sqrt(n) * magnitude

eps is the dtype's machine epsilon (one operation's relative rounding error); n the number of
roundings that accumulate into one output element (a reduction's length, times the layers it
passes through); sqrt(n) because independent rounding errors add like a random walk; magnitude
the size of the values summed, by default the largest |expected|. SLACK is the bound's constant,
with room for machines that round less favourably than the ones the suite was written on.

A real bug (a wrong mask, position, cache slot or weight) moves outputs by O(magnitude), which
stays orders of magnitude above these bounds.
"""

from __future__ import annotations

import math

import torch

SLACK = 16.0


def rounding(dtype: torch.dtype, magnitude: float | torch.Tensor, n: int = 1) -> dict[str, float]:
    """assert_close keywords: n roundings in `dtype` of values of size `magnitude`."""
    if isinstance(magnitude, torch.Tensor):
        magnitude = float(magnitude.detach().abs().max())
    return {"atol": SLACK * torch.finfo(dtype).eps * math.sqrt(n) * magnitude, "rtol": 0.0}


def forward_n(config) -> int:
    """Roundings feeding one output of a transformer forward: each layer's longest reduction
    (the MLP's down projection over intermediate_size, or a projection over dim), in every layer."""
    return config.n_layers * max(config.dim, config.intermediate_size)


def forward(expected: torch.Tensor, config, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Two float computations of a forward's outputs (logits, hidden states, cached K/V)."""
    return rounding(dtype, expected, forward_n(config))


def rounded_activations(expected: torch.Tensor, config, levels: int) -> dict[str, float]:
    """A forward whose projections take their inputs rounded to blocks of `levels` codes a side
    (step max|block| / levels: QuantLinear's act 'i16' or 'q8') against an fp32 forward: every
    input of a reduction carries one rounding like an fp32 one's, with eps 1/levels."""
    eps = torch.finfo(torch.float32).eps + 1 / levels
    return {"atol": SLACK * eps * math.sqrt(forward_n(config)) * float(expected.detach().abs().max()), "rtol": 0.0}


# One step of each cache kind's storage grid, relative to the value (float formats: eps) or to
# its block's largest |value| (quantized: the code spacing; nf4: its codebook's widest gap).
STORAGE_STEP = {"fp32": 0.0, "fp16": torch.finfo(torch.float16).eps, "bf16": torch.finfo(torch.bfloat16).eps,
                "q8_0": 1 / 127.5, "q4_0": 1 / 7.5, "nf4": 0.304, "q4_0l": 1 / 8,
                # zero-point kinds: (max - min) / levels <= 2 max|x| / levels
                "q4_1": 2 / 15, "q4_1c": 2 / 15, "q2_1": 2 / 3, "q2_1c": 2 / 3}


def cache_paths(expected: torch.Tensor, config, kind: str) -> dict[str, float]:
    """Two paths that store K/V computed by differently ordered fp32 arithmetic in a `kind` cache
    (chunked vs whole, a verify forward vs single steps). An fp32 difference can tip a value
    across a rounding boundary of the storage grid, which moves it by one step (seen: one fp16
    ulp in one layer-1 key of a 40-token prompt); the outputs then move by about that step times
    their magnitude. So: the fp32 forward bound plus one storage step of the outputs' magnitude."""
    atol = forward(expected, config)["atol"] + STORAGE_STEP[kind] * float(expected.detach().abs().max())
    return {"atol": atol, "rtol": 0.0}


def reduction(expected: torch.Tensor, n: int) -> dict[str, float]:
    """fp32 results of n-long sums (a matmul's inner dimension), computed in two orders."""
    return rounding(torch.float32, expected, n)


def attention(expected: torch.Tensor, head_dim: int, n_keys: int) -> dict[str, float]:
    """softmax(q k^T) v computed two ways (a chunked read vs SDPA, a C kernel vs torch): the scores
    are head_dim-long dot products and the output an n_keys-long weighted sum, chained."""
    return rounding(torch.float32, expected, head_dim * n_keys)


def elementwise(expected: torch.Tensor, ops: int = 1) -> dict[str, float]:
    """fp32 elementwise arithmetic (no sums) done in another order or form: `ops` roundings."""
    return rounding(torch.float32, expected, ops)
