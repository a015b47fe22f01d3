"""Quantized KV caches: kinds and aliases, round-trip error bounds, nibble packing, byte
accounting, the chunked read path against dequantize + SDPA, key rotation, the residual window,
truncate/reorder on every kind, policies, and generation (batched, multi-turn) on every kind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import caramba.cache.attend as attend
from caramba.cache import (CachePolicy, KindSpec, KVCacheKind, KVCacheTensorConfig, LayerKVCache, kind_names,
                           parse_policy)
from caramba.cache.layer import hadamard
from caramba.cache.quant import (NF4_CODEBOOK, code_values, dequantize, dequantize_channels, pack_codes, pack_nibbles,
                                 quantize, quantize_channels, unpack_codes, unpack_nibbles)
from caramba.infer import GenerateConfig, Generator
import tolerance as tol
from conftest import TINY, make_model

ALL_KINDS = list(kind_names(aliases=False))              # the table's: a new kind is tested here too
QUANT = list(kind_names(aliases=False, quantized_only=True))
V = TINY["vocab_size"]


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- kinds -----------------------------------------------------------------------------------------

def test_aliases_and_unknown_kinds():
    assert KVCacheKind.parse("q8") is KVCacheKind.Q8_0 and KVCacheKind.parse("Q4") is KVCacheKind.Q4_0
    assert KVCacheKind.parse("NF4") is KVCacheKind.NF4
    with pytest.raises(ValueError) as e:
        KVCacheKind.parse("q3_k")
    assert "fp32, fp16, bf16, q8_0, q4_0, nf4" in str(e.value)
    with pytest.raises(ValueError, match="valid kinds"):
        GenerateConfig(cache_kind="int4")
    assert GenerateConfig(cache_kind="q8").cache_kind == "q8_0"


def test_kind_table():
    assert kind_names() == ("fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4", "q4_0l", "q4_1", "q4_1c", "q2_1",
                            "q2_1c", "q8", "q4")
    assert kind_names(aliases=False, quantized_only=True) == ("q8_0", "q4_0", "nf4", "q4_0l", "q4_1", "q4_1c",
                                                              "q2_1", "q2_1c")
    for name in kind_names():   # every listed name parses, and the seed's spellings keep working
        assert KVCacheKind.parse(name).value in kind_names(aliases=False)
    assert KVCacheKind.FP16 == "fp16" and KVCacheKind("q4_0") is KVCacheKind.Q4_0 and KVCacheKind.Q8_0.value == "q8_0"
    specs = {k.value: (k.bits, k.spec.dtype, k.quantized, k.spec.packed, k.spec.kernel) for k in KVCacheKind}
    assert specs == {"fp32": (32, torch.float32, False, False, None), "fp16": (16, torch.float16, False, False, None),
                     "bf16": (16, torch.bfloat16, False, False, None), "q8_0": (8, torch.int8, True, False, 0),
                     "q4_0": (4, torch.uint8, True, True, 1), "nf4": (4, torch.uint8, True, True, 2),
                     "q4_0l": (4, torch.uint8, True, True, 3), "q4_1": (4, torch.uint8, True, True, None),
                     "q4_1c": (4, torch.uint8, True, True, None), "q2_1": (2, torch.uint8, True, True, None),
                     "q2_1c": (2, torch.uint8, True, True, None)}
    with pytest.raises(ValueError, match="eager path"):
        KindSpec("bad", bits=4, dtype=torch.uint8, code_range=(0, 15), zero_point=True, kernel=5)
    with pytest.raises(ValueError, match="uint8 nibbles"):
        KindSpec("bad", bits=4, dtype=torch.int8, code_range=(-8, 7))
    with pytest.raises(ValueError, match="must fit the storage dtype"):
        KindSpec("bad", bits=8, dtype=torch.int8, code_range=(0, 255))
    with pytest.raises(ValueError, match="16 ascending values"):
        KindSpec("bad", bits=4, dtype=torch.uint8, code_range=(0, 15), codebook=(1.0, 0.0))
    with pytest.raises(ValueError, match="no codebook, kernel"):
        KindSpec("bad", bits=16, dtype=torch.float16, kernel=3)


def _reference_quantize(x, kind, block):
    """The per-kind formulas as they were written before the kinds table."""
    xb = x.float().unflatten(-1, (-1, block))
    half = {"q8_0": 127.5, "q4_0": 7.5, "nf4": 1.0}[kind]
    scales = (xb.abs().amax(-1) * ((1 + 2**-10) / half)).to(torch.float16)
    y = xb / scales.float().clamp_min(1e-30).unsqueeze(-1)
    if kind == "q8_0":
        return y.floor().clamp(-128, 127).to(torch.int8).flatten(-2), scales
    if kind == "q4_0":
        u = (y + 8).floor().clamp(0, 15).to(torch.uint8)
    else:
        u = torch.bucketize(y.contiguous(), (NF4_CODEBOOK[1:] + NF4_CODEBOOK[:-1]) / 2).to(torch.uint8)
    u = u.flatten(-2)
    return u[..., : u.shape[-1] // 2] | (u[..., u.shape[-1] // 2 :] << 4), scales


def _reference_dequantize(codes, scales, kind, block):
    if kind == "q8_0":
        values = codes.float() + 0.5
    else:
        u = torch.cat([codes & 15, codes >> 4], dim=-1)
        values = u.float() - 7.5 if kind == "q4_0" else NF4_CODEBOOK[u.long()]
    return (values.unflatten(-1, (-1, block)) * scales.float().unsqueeze(-1)).flatten(-2)


def test_codes_match_reference_formulas():
    # Pinned bytes: codes and fp16 scale bits of two 4-element blocks.
    x = torch.tensor([[1.0, -1.0, 0.5, 0.0, 0.3, -0.02, 2.0, -0.7]])
    pinned = {"q8_0": ([127, -128, 63, 0, 19, -2, 127, -45], [8197, 9221]),
              "q4_0": ([159, 112, 251, 88], [12357, 13381]),
              "nf4": ([159, 112, 252, 55], [15361, 16385])}
    for kind, (codes, scale_bits) in pinned.items():
        c, s = quantize(x, kind, 4)
        assert c[0].tolist() == codes and s[0].view(torch.int16).tolist() == scale_bits, kind
    # And the same codes, scales and values as the old per-kind formulas on random data.
    x = randn(2, 3, 5, 64, seed=7, scale=3.0)
    x[0, 0, 0] = 0   # an all-zero head
    for kind in ("q8_0", "q4_0", "nf4"):
        for block in (8, 32, 64):
            c, s = quantize(x, kind, block)
            rc, rs = _reference_quantize(x, kind, block)
            assert c.dtype == rc.dtype and torch.equal(c, rc) and torch.equal(s, rs), (kind, block)
            assert torch.equal(dequantize(c, s, kind, block), _reference_dequantize(rc, rs, kind, block))


def test_a_new_kind_is_one_spec():
    """A kind no module names: quantize, dequantize and both decode read paths work from its spec."""
    q6 = KindSpec("q6_0", bits=8, dtype=torch.int8, code_range=(-32, 31))   # 64 uniform levels
    x = randn(1, 2, 9, 32, seed=3)
    c, s = quantize(x, q6, 16)
    assert c.dtype == torch.int8 and int(c.min()) >= -32 and int(c.max()) <= 31
    step = s.float().repeat_interleave(16, dim=-1)
    assert bool(((dequantize(c, s, q6, 16) - x).abs() <= step / 2 + 1e-6).all())
    assert torch.equal(code_values(c, q6, torch.float32), c.float() + 0.5)
    values, offset = attend._code_values(c, q6, -1, torch.float32)
    assert torch.equal(values + offset, c.float() + 0.5)


def test_a_kind_without_kernel_reads_through_the_eager_path(monkeypatch):
    """kernel=None in a spec: decode takes the eager path, with the same result as the C one."""
    import dataclasses
    cache = LayerKVCache(1, 40, 32, 32, KVCacheTensorConfig("q4_0", 16), KVCacheTensorConfig("q4_0", 16), n_kv_heads=2)
    cache.attend(randn(1, 4, 30, 16, seed=1), randn(1, 2, 30, 16, seed=2), randn(1, 2, 30, 16, seed=3), None, True)
    q = randn(1, 4, 1, 16, seed=4)
    fast = attend.attend_chunked(q, cache.k_stream, cache.v_stream, 30, None)
    for stream in cache.streams:
        stream.spec = dataclasses.replace(stream.spec, kernel=None)
    monkeypatch.setattr(attend.kernel, "key_scores", None)   # would raise if called
    monkeypatch.setattr(attend.kernel, "value_mix", None)
    eager = attend.attend_chunked(q, cache.k_stream, cache.v_stream, 30, None)
    torch.testing.assert_close(eager, fast, atol=1e-5, rtol=1e-5)


def test_policy_parsing():
    assert parse_policy("k=q8_0, v=q4") == {"k": "q8_0", "v": "q4_0"}
    assert parse_policy({"k": "nf4"}) == {"k": "nf4"}
    p = CachePolicy.build("q4_0", "k=q8_0", qblock=16, residual_len=4, rotate_keys=True, fp16_prefix_layers=1)
    assert (p.k.kind.value, p.v.kind.value, p.k.qblock, p.v.residual_len) == ("q8_0", "q4_0", 16, 4)
    assert p.describe() == "k=q8_0,v=q4_0 qblock=16 residual_len=4 rotate_keys fp16_prefix_layers=1"
    with pytest.raises(ValueError, match="unknown stream"):
        parse_policy("q=q8_0")
    with pytest.raises(ValueError, match="stream=kind"):
        parse_policy("q8_0")
    with pytest.raises(ValueError, match="valid kinds"):
        parse_policy("k=q2")
    with pytest.raises(ValueError, match="qblock=3"):
        KVCacheTensorConfig("q8_0", qblock=3)
    with pytest.raises(ValueError, match="must divide head_dim=16"):
        KVCacheTensorConfig("q8_0", qblock=12).block_for(16)
    assert KVCacheTensorConfig("q8_0", qblock=32).block_for(16) == 16   # clipped to one head


# ---- quantization ----------------------------------------------------------------------------------

PER_CHANNEL = [k for k in QUANT if KVCacheKind(k).spec.per_channel]
ZERO_POINT = [k for k in QUANT if KVCacheKind(k).spec.zero_point]


@pytest.mark.parametrize("kind", [k for k in QUANT if KVCacheKind(k).spec.levels is None    # uniform mid-rise
                                  and not KVCacheKind(k).spec.mid_tread and k not in ZERO_POINT])
@pytest.mark.parametrize("block", [8, 32])
def test_uniform_round_trip_error_is_at_most_half_a_step(kind, block):
    x = randn(2, 3, 7, 64, seed=1) * torch.linspace(0.01, 5, 64)   # channels of very different size
    codes, scales = quantize(x, KVCacheKind(kind), block)
    assert scales.dtype == torch.float16 and scales.shape == (2, 3, 7, 64 // block)
    x_hat = dequantize(codes, scales, KVCacheKind(kind), block)
    err = (x - x_hat).abs().unflatten(-1, (-1, block))
    step = scales.float().unsqueeze(-1)
    assert bool((err <= step / 2 + 1e-6).all())
    assert float((err / step).max()) > 0.4            # the bound is tight, not vacuous


def _llamacpp_q4_0(x, block, d=None):
    """llama.cpp's quantize_row_q4_0_ref / dequantize_row_q4_0, elementwise: d = max / -8 with
    max the signed element of largest magnitude, q = min(15, trunc(x / d + 8.5)), x^ = (q - 8) d.
    `d`: use this (stored fp16) scale for the codes instead of the float one."""
    xb = x.float().unflatten(-1, (-1, block))
    peak = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))
    d = peak / -8 if d is None else d.float().unsqueeze(-1)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (xb * inv + 8.5).trunc().clamp(max=15)
    return q.flatten(-2), ((q - 8) * d).flatten(-2)


@pytest.mark.parametrize("block", [8, 32])
def test_q4_0l_is_llamacpp_q4_0(block):
    x = randn(2, 3, 7, 64, seed=11) * torch.linspace(0.01, 5, 64)
    x[0, 0, 0, :block] = 0                      # an all-zero block: code 8 (zero) everywhere
    codes, scales = quantize(x, "q4_0l", block)
    u, ref = _llamacpp_q4_0(x, block, d=scales)
    assert torch.equal(unpack_nibbles(codes).float(), u)
    assert torch.equal(dequantize(codes, scales, "q4_0l", block), ref)
    # The stored scale is llama.cpp's d = max/-8 rounded to fp16 (up in magnitude, by <= 2^-10 + 2^-11).
    u_exact, _ = _llamacpp_q4_0(x, block)   # llama.cpp codes from the unrounded d: rarely a neighbour
    d = (x.unflatten(-1, (-1, block)).gather(-1, x.unflatten(-1, (-1, block)).abs().argmax(-1, keepdim=True))[..., 0]
         / -8)
    assert bool(((scales.float() - d).abs() <= d.abs() * 2**-9).all()) and bool((scales.float() * d >= 0).all())
    assert float((u - u_exact).abs().max()) <= 1 and float((u != u_exact).float().mean()) < 0.01
    # Zero is a level, the peak is exact, every code is reachable.
    assert bool((dequantize(codes, scales, "q4_0l", block)[0, 0, 0, :block] == 0).all())
    peak_err = (dequantize(codes, scales, "q4_0l", block) - x).unflatten(-1, (-1, block)).gather(
        -1, x.unflatten(-1, (-1, block)).abs().argmax(-1, keepdim=True))
    assert float(peak_err.abs().max()) <= float(x.abs().max()) * 2**-9
    assert len(torch.unique(unpack_nibbles(codes))) == 16


def test_q4_0l_pinned_codes():
    x = torch.tensor([[1.0, -1.0, 0.5, 0.0, 0.3, -0.02, 2.0, -0.7]])
    c, s = quantize(x, "q4_0l", 4)
    # peak +1.0 -> d = -1/8 (stored -0.12512): 1 -> 0, -1 -> 16 clipped to 15, 0.5 -> 4, 0 -> 8;
    # peak 2.0 -> d = -1/4: 0.3 -> trunc(-1.2 + 8.5) = 7, -0.02 -> 8, -0.7 -> 11
    assert unpack_nibbles(c)[0].tolist() == [0, 15, 4, 8, 7, 8, 0, 11]
    assert s[0].tolist() == [-0.1251220703125, -0.250244140625]


def _reference_zero_point(x, bits, block):
    """Asymmetric per-block quantization spelled out: m = min (fp16, rounded down), s = (max - m) /
    (2^bits - 1) (fp16, rounded up), u = round((x - m) / s), x^ = m + u s."""
    xb = x.float().unflatten(-1, (-1, block))
    lo = xb.amin(-1)
    m = lo.half()
    m = torch.where(m.float() > lo, torch.nextafter(m, torch.tensor(-float("inf"), dtype=torch.float16)), m)
    top = 2**bits - 1
    s = ((xb.amax(-1) - m.float()) * (1 + 2**-10) / top).half()
    u = torch.where(s[..., None] == 0, torch.zeros_like(xb), ((xb - m.float()[..., None]) / s.float()[..., None] + 0.5)
                    .floor().clamp(0, top))
    return u.flatten(-2), (m.float()[..., None] + u * s.float()[..., None]).flatten(-2), s


@pytest.mark.parametrize("kind,bits", [("q4_1", 4), ("q2_1", 2)])
@pytest.mark.parametrize("block", [8, 32])
def test_zero_point_kinds_match_the_reference_and_err_at_most_half_a_step(kind, bits, block):
    x = randn(2, 3, 7, 64, seed=12) * torch.linspace(0.01, 5, 64) + torch.linspace(-3, 3, 64)   # offset channels
    x[0, 0, 0, :block] = 0.25   # a constant block: scale 0, every element exact
    codes, params = quantize(x, kind, block)
    assert params.shape == (2, 3, 7, 2 * 64 // block) and codes.shape[-1] == 64 * bits // 8
    u, ref, s = _reference_zero_point(x, bits, block)
    assert torch.equal(code_values(codes, kind, torch.float32), u)
    x_hat = dequantize(codes, params, kind, block)
    torch.testing.assert_close(x_hat, ref, **tol.elementwise(ref, ops=2))
    err = (x_hat - x).abs().unflatten(-1, (-1, block))
    assert bool((err <= s.float()[..., None] / 2 + tol.elementwise(x, ops=3)["atol"]).all())
    assert bool((x_hat[0, 0, 0, :block] == 0.25).all())
    assert len(torch.unique(u)) == 2**bits


@pytest.mark.parametrize("kind", PER_CHANNEL)
def test_per_channel_codes_are_per_token_codes_of_the_transpose(kind):
    """A per-channel group of G tokens is the per-token block of the transposed [D, G] slice."""
    per_token = kind[:-1]   # q4_1c -> q4_1
    x = randn(2, 3, 24, 16, seed=13) * torch.linspace(0.1, 8, 16)   # channels of very different size
    codes, params = quantize_channels(x, kind, 8)
    assert params.shape == (2, 3, 3, 2 * 16)
    ref = dequantize(*quantize(x.unflatten(-2, (3, 8)).transpose(-1, -2), per_token, 8), per_token, 8)
    torch.testing.assert_close(dequantize_channels(codes, params, kind, 8), ref.transpose(-1, -2).flatten(-3, -2),
                               **tol.elementwise(ref, ops=2))
    # per channel beats per token on channels of different size
    tok = dequantize(*quantize(x, per_token, 16), per_token, 16)
    assert float((dequantize_channels(codes, params, kind, 8) - x).abs().mean()) < float((tok - x).abs().mean())
    with pytest.raises(ValueError, match="do not fill groups of 8"):
        quantize_channels(x[:, :, :20], kind, 8)


def test_two_bit_packing():
    u = torch.randint(0, 4, (3, 16), dtype=torch.uint8)
    packed = pack_codes(u, 2)
    assert packed.shape == (3, 4) and torch.equal(packed & 3, u[:, :4]) and torch.equal(packed >> 6, u[:, 12:])
    assert torch.equal(unpack_codes(packed, 2), u)


def test_codes_use_the_full_range():
    x = randn(4, 2, 16, 64, seed=2)
    c8, _ = quantize(x, KVCacheKind.Q8_0, 32)
    assert int(c8.min()) == -128 and int(c8.max()) == 127
    c4, _ = quantize(x, KVCacheKind.Q4_0, 32)
    u = unpack_nibbles(c4)
    assert int(u.min()) == 0 and int(u.max()) == 15 and len(torch.unique(u)) == 16


def test_nf4_uses_the_qlora_codebook():
    assert len(NF4_CODEBOOK) == 16 and float(NF4_CODEBOOK[0]) == -1 and float(NF4_CODEBOOK[7]) == 0
    x = randn(2, 2, 5, 32, seed=3)
    codes, scales = quantize(x, KVCacheKind.NF4, 32)
    x_hat = dequantize(codes, scales, KVCacheKind.NF4, 32)
    # Every value is a codebook entry times its block's absmax ...
    ratio = x_hat / scales.float()
    assert bool(torch.isclose(ratio[..., None], NF4_CODEBOOK, **tol.elementwise(NF4_CODEBOOK, ops=2)).any(-1).all())   # x scale / scale
    # ... the nearest one: the error is at most half the widest gap of the codebook.
    half_gap = float((NF4_CODEBOOK[1:] - NF4_CODEBOOK[:-1]).max()) / 2
    assert bool(((x - x_hat).abs() <= scales.float() * half_gap + tol.elementwise(x, ops=2)["atol"]).all())
    assert float((x / scales.float()).abs().amax()) <= 1.0


def test_scales_are_the_stored_fp16_values():
    x = randn(1, 1, 3, 32, seed=4) * 3
    codes, scales = quantize(x, KVCacheKind.Q8_0, 32)
    assert torch.equal(dequantize(codes, scales, KVCacheKind.Q8_0, 32), (codes.float() + 0.5) * scales.float())


def test_zero_block_round_trips_to_zero():
    x = torch.zeros(1, 1, 2, 32)
    for kind in QUANT:
        codes, scales = quantize(x, KVCacheKind(kind), 16)
        assert not scales.any() and torch.equal(dequantize(codes, scales, KVCacheKind(kind), 16), x)


def test_nibble_packing():
    u = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_nibbles(u)
    assert packed.shape == (3, 4) and packed.dtype == torch.uint8
    assert torch.equal(packed & 15, u[:, :4]) and torch.equal(packed >> 4, u[:, 4:])
    assert torch.equal(unpack_nibbles(packed), u)


def test_a_block_never_spans_two_heads():
    # head 0 tiny, head 1 huge: head 0's error must follow its own scale.
    k = torch.cat([randn(1, 1, 4, 16, seed=5) * 1e-3, randn(1, 1, 4, 16, seed=6) * 1e3], dim=1)
    cfg = KVCacheTensorConfig("q4_0", qblock=32)
    c = LayerKVCache(1, 8, 32, 32, cfg, cfg, "cpu", 2)
    keys, _ = c.update(k, k)
    # half a step of head 0's own range (it would be ~1e3/15 if the block took in head 1)
    assert float((keys[:, 0] - k[:, 0]).abs().max()) <= float(k[:, 0].abs().max()) / 15 * 1.01


# ---- the layer cache -------------------------------------------------------------------------------

def layer(kind, B=2, S=24, H=2, D=16, qblock=8, residual_len=0, rotate=False, v_kind=None, rotate_values=False):
    k_cfg = KVCacheTensorConfig(kind, qblock, residual_len)
    v_cfg = KVCacheTensorConfig(v_kind or kind, qblock, residual_len)
    return LayerKVCache(B, S, H * D, H * D, k_cfg, v_cfg, "cpu", H, rotate_keys=rotate, rotate_values=rotate_values)


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("residual_len", [0, 5])
def test_allocated_bytes_equal_the_analytic_formula(kind, residual_len):
    B, S, H, D = 2, 24, 2, 16
    c = layer(kind, B, S, H, D, residual_len=residual_len)
    spec = KVCacheKind(kind).spec
    other = D * spec.bits // 8 + 2 * 2 * spec.quantized    # a kind added to the table later
    per_token = {"fp32": 4 * D, "fp16": 2 * D, "bf16": 2 * D, "q8_0": D + 2 * 2, "q4_0": D // 2 + 2 * 2,
                 "nf4": D // 2 + 2 * 2,     # codes + one fp16 scale per block of 8
                 "q4_1": D // 2 + 2 * 2 * 2, "q2_1": D // 4 + 2 * 2 * 2,    # + one fp16 minimum per block
                 # per channel: a group of 8 tokens stores D scales and D minimums
                 "q4_1c": D // 2 + D * 2 * 2 // 8, "q2_1c": D // 4 + D * 2 * 2 // 8}.get(kind, other) * H
    assert c.bytes_per_token() == B * 2 * per_token
    # fp32 window for K and V; a per-channel kind's ring also holds two groups being filled
    ring_len = residual_len + 2 * 8 * (kind in PER_CHANNEL)
    ring = B * 2 * ring_len * H * D * 4 if kind in QUANT else 0
    assert c.nbytes == S * c.bytes_per_token() + ring
    streams = [c.k_stream, c.v_stream]
    assert c.nbytes == sum(t.numel() * t.element_size() for s in streams for t in s.tensors())


@pytest.mark.parametrize("kind", QUANT)
def test_update_returns_the_dequantized_prefix(kind):
    c = layer(kind)
    k1, v1 = randn(2, 2, 3, 16, seed=1), randn(2, 2, 3, 16, seed=2)
    k, v = c.update(k1, v1)
    # a per-channel group of 8 tokens is quantized once full: these 3 are still exact
    ref_k = k1 if kind in PER_CHANNEL else dequantize(*quantize(k1, KVCacheKind(kind), 8), KVCacheKind(kind), 8)
    assert torch.equal(k, ref_k)
    k2, v2 = randn(2, 2, 2, 16, seed=3), randn(2, 2, 2, 16, seed=4)
    k, v = c.update(k2, v2)
    assert k.shape == v.shape == (2, 2, 5, 16) and torch.equal(k[:, :, :3], ref_k)
    half_step = tol.STORAGE_STEP[kind] / 2 * float(torch.cat([v1, v2], 2).abs().max())
    assert float((v - torch.cat([v1, v2], 2)).abs().max()) <= half_step * 1.01


def sdpa_reference(c: LayerKVCache, q, mask):
    keys, values = c.k_stream.read(c.length, q.dtype), c.v_stream.read(c.length, q.dtype)
    if c.rotation is not None:
        q = q @ c.rotation
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return out if c.v_rotation is None else out @ c.v_rotation


@pytest.mark.parametrize("kind,v_kind", [("q8_0", None), ("q4_0", None), ("nf4", None), ("q8_0", "q4_0"),
                                          ("fp16", "q4_0"), ("nf4", "fp32"), ("q4_0l", None), ("q4_1c", "q4_1"),
                                          ("q2_1c", "q2_1")])
@pytest.mark.parametrize("residual_len,rotate,qblock", [(0, False, 8), (6, False, 8), (0, True, 8), (0, False, 16)])
def test_chunked_read_equals_dequantize_then_sdpa(kind, v_kind, residual_len, rotate, qblock, read_path, monkeypatch):
    monkeypatch.setattr(attend, "READ_CHUNK", 7)            # several chunks plus a ragged one
    c = layer(kind, S=40, qblock=qblock, residual_len=residual_len, rotate=rotate, v_kind=v_kind)
    c.update(randn(2, 2, 20, 16, seed=1), randn(2, 2, 20, 16, seed=2))
    q, k, v = randn(2, 4, 1, 16, seed=3), randn(2, 2, 1, 16, seed=4), randn(2, 2, 1, 16, seed=5)
    got = c.attend(q, k, v, None, False)                   # one decode step: the chunked path
    torch.testing.assert_close(got, sdpa_reference(c, q, None), **tol.attention(got, 16, c.length))
    # three queries at once (speculative verify) with a mask that hides a padding slot
    q3, k3, v3 = randn(2, 4, 3, 16, seed=6), randn(2, 2, 3, 16, seed=7), randn(2, 2, 3, 16, seed=8)
    S = c.length + 3
    mask = (torch.arange(S)[None, :] <= torch.arange(c.length, S)[:, None]).expand(2, 3, S).clone()
    mask[1, :, 2] = False
    mask = mask[:, None]
    got = c.attend(q3, k3, v3, mask, False)
    torch.testing.assert_close(got, sdpa_reference(c, q3, mask), **tol.attention(got, 16, S))


def test_rotation_is_orthogonal_and_keeps_attention_exact():
    h = hadamard(16)
    torch.testing.assert_close(h @ h, torch.eye(16), **tol.reduction(torch.eye(16), 16))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(12)
    plain, rotated = layer("fp32"), layer("fp32", rotate=True)
    kv = randn(2, 2, 9, 16, seed=1), randn(2, 2, 9, 16, seed=2)
    q = randn(2, 4, 1, 16, seed=3)
    a = plain.attend(q, *kv, None, False)
    b = rotated.attend(q, *kv, None, False)
    torch.testing.assert_close(a, b, **tol.attention(a, 16 * 16, 10))   # rotating q and k adds a 16-long sum to each
    k, _ = rotated.update(randn(2, 2, 1, 16, seed=4), randn(2, 2, 1, 16, seed=5))
    torch.testing.assert_close(k[:, :, :9], kv[0], **tol.reduction(kv[0], 16 * 16))   # update() undoes the rotation: two 16-long sums


def pair_order(D):
    """llama.cpp's key channel order: RoPE pair (i, i + D/2) of the half-split layout at (2i, 2i + 1)."""
    half = torch.arange(D // 2)
    return torch.stack([half, half + D // 2], 1).flatten()


@pytest.mark.parametrize("kind", ["q4_0", "q4_0l", "q8_0", "nf4", "q4_1"])
@pytest.mark.parametrize("rotate", [False, True])
def test_keys_in_pair_order_through_the_key_rotation(kind, rotate):
    """Any orthogonal key matrix works in the rotation's place (benchmarks/kv_quality.py's
    key_order=pairs sets a permutation): the stored codes are the codes of the permuted vectors,
    bit for bit, and attention equals attention over the unpermuted dequantized keys."""
    D, order = 16, pair_order(16)
    c = layer(kind, S=40, qblock=8, rotate=rotate)
    P = torch.eye(D)[:, order]                               # x @ P == x[..., order]
    rot = P if c.rotation is None else P @ c.rotation
    c.rotation, c.unrotation = rot, rot.T.contiguous()
    k, v = randn(2, 2, 20, D, seed=1), randn(2, 2, 20, D, seed=2)
    keys, _ = c.update(k, v)
    stored = k[..., order] if not rotate else k @ rot
    codes, scales = quantize(stored, KVCacheKind(kind), 8)
    if not rotate:   # a gather moves elements without arithmetic: the very same codes
        assert torch.equal(c.k_stream.codes[..., :20].transpose(-1, -2), codes)
        assert torch.equal(c.k_stream.scales[..., :20].transpose(-1, -2), scales)
    deq = dequantize(codes, scales, KVCacheKind(kind), 8) @ rot.T   # back in the model's order
    torch.testing.assert_close(keys, deq, **tol.reduction(deq, 2 * D))
    q = randn(2, 4, 1, D, seed=3)
    got = c.attend(q, randn(2, 2, 1, D, seed=4), randn(2, 2, 1, D, seed=5), None, False)
    keys_all = c.k_stream.read(c.length, q.dtype) @ rot.T            # unpermuted dequantized keys
    ref = F.scaled_dot_product_attention(q, keys_all, c.v_stream.read(c.length, q.dtype), enable_gqa=True)
    torch.testing.assert_close(got, ref, **tol.attention(ref, 2 * D, c.length))


@pytest.mark.parametrize("kind,v_kind", [("q4_0", None), ("q4_0l", None), ("q4_1c", "q4_1"), ("fp32", "q4_0l"),
                                          ("q8_0", "nf4")])
@pytest.mark.parametrize("rotate", [False, True])
def test_value_rotation_stores_rotated_values_and_undoes_it_on_the_output(kind, v_kind, rotate, read_path, monkeypatch):
    monkeypatch.setattr(attend, "READ_CHUNK", 7)
    D = 16
    c = layer(kind, S=40, rotate=rotate, v_kind=v_kind, rotate_values=True)
    vk = KVCacheKind(v_kind or kind)
    k, v = randn(2, 2, 20, D, seed=1), randn(2, 2, 20, D, seed=2)
    _, values = c.update(k, v)
    H = hadamard(D)
    # what the value stream holds: the codes of v H (block by block), read back un-rotated
    ref = dequantize(*quantize(v @ H, vk, 8), vk, 8)
    torch.testing.assert_close(c.v_stream.read(20, torch.float32), ref, **tol.reduction(ref, D))
    torch.testing.assert_close(values, ref @ H, **tol.reduction(ref, 2 * D))
    q, k1, v1 = randn(2, 4, 1, D, seed=3), randn(2, 2, 1, D, seed=4), randn(2, 2, 1, D, seed=5)
    got = c.attend(q, k1, v1, None, False)                     # decode: the chunked (C or eager) path
    torch.testing.assert_close(got, sdpa_reference(c, q, None), **tol.attention(got, 2 * D, c.length))
    q3, k3, v3 = randn(2, 4, 3, D, seed=6), randn(2, 2, 3, D, seed=7), randn(2, 2, 3, D, seed=8)
    S = c.length + 3
    mask = (torch.arange(S)[None, :] <= torch.arange(c.length, S)[:, None]).expand(2, 3, S).clone()
    mask[1, :, 2] = False
    got = c.attend(q3, k3, v3, mask[:, None], False)
    torch.testing.assert_close(got, sdpa_reference(c, q3, mask[:, None]), **tol.attention(got, 2 * D, S))


def test_value_rotation_on_a_float_cache_keeps_attention_exact():
    plain, rotated = layer("fp32"), layer("fp32", rotate_values=True)
    kv = randn(2, 2, 9, 16, seed=1), randn(2, 2, 9, 16, seed=2)
    q = randn(2, 4, 1, 16, seed=3)
    a = plain.attend(q, *kv, None, False)
    b = rotated.attend(q, *kv, None, False)
    torch.testing.assert_close(a, b, **tol.attention(a, 16 * 16, 10))   # v H and out H: two 16-long sums more
    _, v = rotated.update(randn(2, 2, 1, 16, seed=4), randn(2, 2, 1, 16, seed=5))
    torch.testing.assert_close(v[:, :, :9], kv[1], **tol.reduction(kv[1], 16 * 16))
    with pytest.raises(ValueError, match="power-of-two"):
        LayerKVCache(1, 4, 12, 12, KVCacheTensorConfig("q4_0", 4), KVCacheTensorConfig("q4_0", 4), "cpu", 1,
                     rotate_values=True)


def test_rotation_cuts_4bit_key_error_on_outlier_channels():
    k = randn(1, 2, 64, 16, seed=1)
    k[..., 3] *= 20                                           # an outlier channel, as real keys have
    errs = {}
    for rotate in (False, True):
        c = layer("q4_0", B=1, S=64, qblock=16, rotate=rotate)
        keys, _ = c.update(k, k)
        errs[rotate] = float((keys - k).norm() / k.norm())
    assert errs[True] < 0.6 * errs[False]


def channel_reference(x, kind, G, residual_len=0):
    """What a per-channel stream holding x [B, H, T, D] reads: complete groups of G tokens
    quantized per channel, the incomplete tail (and the newest residual_len tokens) exact."""
    T = x.shape[2]
    q_end = T // G * G
    out = x.clone()
    if q_end:
        out[:, :, :q_end] = dequantize_channels(*quantize_channels(x[:, :, :q_end], kind, G), kind, G)
    r0 = min(q_end, max(T - residual_len, 0))
    out[:, :, r0:] = x[:, :, r0:]
    return out


@pytest.mark.parametrize("kind", PER_CHANNEL)
@pytest.mark.parametrize("pieces,residual_len", [([1] * 21, 0), ([5, 3, 9, 4], 0), ([20, 1], 0), ([3, 7, 11], 6)])
def test_per_channel_stream_quantizes_each_group_once_it_is_complete(kind, pieces, residual_len):
    G = 8
    x = randn(2, 2, sum(pieces), 16, seed=21) * torch.linspace(0.1, 6, 16)
    c = layer(kind, S=24, qblock=G, residual_len=residual_len)
    t = 0
    for n in pieces:
        keys, values = c.update(x[:, :, t : t + n], x[:, :, t : t + n])
        t += n
        ref = channel_reference(x[:, :, :t], kind, G, residual_len)
        assert torch.equal(keys, ref) and torch.equal(values, ref), t
    assert c.k_stream.fp_start(t) == min(t // G * G, max(t - residual_len, 0))


@pytest.mark.parametrize("kind", PER_CHANNEL)
def test_per_channel_rollback_into_a_quantized_group(kind):
    G = 8
    x, y = randn(1, 2, 40, 16, seed=22), randn(1, 2, 40, 16, seed=23)
    # shallow: the ring (2G slots) still holds the group's tokens: exactly as if never written
    c = layer(kind, B=1, S=40, qblock=G)
    c.update(x[:, :, :13], x[:, :, :13])
    c.update(y[:, :, :4], y[:, :, :4])          # completes group [8, 16) with rejected tokens
    c.truncate(13)
    keys, _ = c.update(x[:, :, 13:20], x[:, :, 13:20])
    assert torch.equal(keys, channel_reference(x[:, :, :20], kind, G))
    # deep: the ring has moved on; the group's head comes back from its codes and is quantized again
    c.update(y[:, :, :20], y[:, :, :20])        # 40 tokens: every slot of the ring rewritten
    c.truncate(11)
    keys, _ = c.update(x[:, :, 11:16], x[:, :, 11:16])
    head = channel_reference(x[:, :, :16], kind, G)[:, :, 8:11]     # what the codes held
    regroup = torch.cat([head, x[:, :, 11:16]], dim=2)
    assert torch.equal(keys[:, :, :8], channel_reference(x[:, :, :8], kind, G)[:, :, :8])
    assert torch.equal(keys[:, :, 8:16], dequantize_channels(*quantize_channels(regroup, kind, G), kind, G))


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    k = randn(1, 2, 64, 16, seed=1) + 3.0                     # offset channels ...
    k[..., 3] *= 20                                           # ... and an outlier one, as real keys have
    errs = {}
    for kind in ("q4_0", "q4_1", "q4_1c", "q2_1c", "q2_1"):
        c = layer(kind, B=1, S=64, qblock=16)
        keys, _ = c.update(k, k)
        errs[kind] = float((keys - k).norm() / k.norm())
    assert errs["q4_1c"] < 0.5 * errs["q4_1"] < errs["q4_0"] and errs["q2_1c"] < errs["q2_1"]


def test_a_ring_buffer_cache_refuses_per_channel_kinds():
    from caramba.cache.ring import RingKVCache
    with pytest.raises(ValueError, match="per-channel kind"):
        RingKVCache.build(make_model(), 1, 8, 4, CachePolicy.build("q4_1c", qblock=4))


def test_residual_window_keeps_the_newest_tokens_exact():
    c = layer("q4_0", S=20, residual_len=4)
    k = randn(2, 2, 10, 16, seed=1)
    keys, _ = c.update(k, k)
    assert torch.equal(keys[:, :, 6:], k[:, :, 6:])           # newest 4: full precision
    assert not torch.equal(keys[:, :, :6], k[:, :, :6])       # older: quantized
    c.truncate(8)                                             # slots of 4, 5 were overwritten by 8, 9
    keys, _ = c.update(k[:, :, 8:9], k[:, :, 8:9])
    assert torch.equal(keys[:, :, 6:9], k[:, :, 6:9])
    assert not torch.equal(keys[:, :, 5], k[:, :, 5])
    c.reset()
    keys, _ = c.update(k[:, :, :3], k[:, :, :3])
    assert torch.equal(keys, k[:, :, :3])


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_reorder_gathers_rows_on_every_kind(kind):
    c = layer(kind, B=3, residual_len=2)
    k, v = randn(3, 2, 4, 16, seed=1), randn(3, 2, 4, 16, seed=2)
    before_k, before_v = c.update(k, v)
    nbytes = c.nbytes
    c.reorder(torch.tensor([2, 0]))
    assert c.batch_size == 2 and c.nbytes == nbytes * 2 // 3
    after_k, after_v = c.k_stream.read(4, torch.float32), c.v_stream.read(4, torch.float32)
    assert torch.equal(after_k, before_k[[2, 0]]) and torch.equal(after_v, before_v[[2, 0]])


# ---- the model with every kind -------------------------------------------------------------------

def tokens(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_truncate_rolls_back_on_every_kind(model, kind):
    assert_truncate_rolls_back(model, CachePolicy.build(kind, qblock=8), kind)


def assert_truncate_rolls_back(model, policy, kind):
    prefix, rejected, accepted = tokens(2, 6, seed=1), tokens(2, 4, seed=2), tokens(2, 5, seed=3)
    clean = model.new_cache(2, 20, policy)
    model(prefix, cache=clean)
    expected = torch.cat([model(accepted[:, t : t + 1], cache=clean) for t in range(5)], dim=1)
    cache = model.new_cache(2, 20, policy)
    model(prefix, cache=cache)
    model(rejected, cache=cache)
    cache.truncate(6)
    got = torch.cat([model(accepted[:, t : t + 1], cache=cache) for t in range(5)], dim=1)
    torch.testing.assert_close(got, expected, **tol.forward(expected, model.config))
    cache.truncate(6)   # a verify-sized forward reads the same cache contents as 5 single steps
    # ... up to one storage step where its differently ordered K/V land across a rounding boundary
    torch.testing.assert_close(model(accepted, cache=cache), expected, **tol.cache_paths(expected, model.config, kind))
    return cache


@pytest.mark.parametrize("kind,tol", [("q8_0", 0.02), ("q4_0", 0.5), ("nf4", 0.5)])
def test_quantized_cache_logits_are_close_to_fp32(kind, tol):
    model = make_model(std=0.1)      # a tamer model: the default tiny one amplifies any error
    x = tokens(2, 24, seed=6)
    out = {}
    for name in ("fp32", kind):
        cache = model.new_cache(2, 24, CachePolicy.build(name, qblock=8))
        out[name] = torch.cat([model(x[:, :4], cache=cache)] + [model(x[:, t : t + 1], cache=cache) for t in range(4, 24)], 1)
    err = float((out[kind] - out["fp32"]).abs().max() / out["fp32"].abs().max())
    assert 0 < err < tol


def test_value_rotation_policy(model):
    p = CachePolicy.build("q4_0l", "k=q4_1c", rotate_values=True, fp16_prefix_layers=1)
    assert p.describe() == "k=q4_1c,v=q4_0l rotate_values fp16_prefix_layers=1"
    assert p.to_dict()["rotate_values"] is True and "rotate_values" not in CachePolicy.build("q4_0").to_dict()
    cache = model.new_cache(1, 8, p)
    first, second = cache.layers
    assert first.v_rotation is None and second.v_rotation is not None and second.rotation is None
    with pytest.raises(ValueError, match="decoupled"):
        p.check_streams(decoupled=True)
    # streams with their own qblock (CachePolicy built per stream) say so
    mixed = CachePolicy(KVCacheTensorConfig("q4_1c", 16), KVCacheTensorConfig("q4_1", 32))
    assert mixed.describe() == "k=q4_1c,v=q4_1 qblock=k:16,v:32"
    assert CachePolicy(KVCacheTensorConfig("fp16", 16), KVCacheTensorConfig("q4_0", 16)).describe() == "k=fp16,v=q4_0 qblock=16"


@pytest.mark.parametrize("kind", ["q4_0", "q4_0l", "q8_0"])
def test_truncate_rolls_back_with_rotated_keys_and_values(model, kind):
    cache = assert_truncate_rolls_back(model, CachePolicy.build(kind, qblock=8, rotate_keys=True, rotate_values=True), kind)
    cache.reorder(torch.tensor([1]))   # beam search / finished rows: the rotated streams gather too
    assert cache.batch_size == 1 and cache.layers[1].v_stream.codes.shape[0] == 1


def test_policy_per_layer_and_stream(model):
    cache = model.new_cache(1, 8, CachePolicy.build("q4_0", "k=q8_0", qblock=8, fp16_prefix_layers=1, rotate_keys=True))
    first, second = cache.layers
    assert first.k.dtype == first.v.dtype == torch.float16 and first.rotation is None
    assert second.k.dtype == torch.int8 and second.v.dtype == torch.uint8 and second.rotation is not None
    assert cache.bytes_per_token() == first.bytes_per_token() + second.bytes_per_token()


def q_config(kind, **kw):
    return GenerateConfig(**{"temperature": 0.0, "max_seq_len": 64, "cache_kind": kind, "qblock": 8, **kw})


# Per-channel kinds are left out: a row's left padding shares its token groups with real tokens,
# so its group ranges (and codes) differ from the prompt alone (tested for the per-token kinds).
@pytest.mark.parametrize("kind", [k for k in ALL_KINDS if k not in PER_CHANNEL])
def test_ragged_batch_equals_each_prompt_alone_on_every_kind(model, prompts, kind):
    batched = Generator(model, q_config(kind, max_new_tokens=8)).run(prompts).sequences
    alone = [Generator(model, q_config(kind, max_new_tokens=8)).run([p]).sequences[0] for p in prompts]
    assert batched == alone


def manual_session(model, policy, turns, n):
    """What a multi-turn session must do, spelled out: prefill (pending token + turn), then n - 1
    one-token steps; the last token of a turn goes in with the next turn."""
    cache, pending, outs = model.new_cache(1, 64, policy), [], []
    for turn in turns:
        logits = model(torch.tensor([pending + turn]), cache=cache)[:, -1]
        out = []
        for i in range(n):
            out.append(int(logits.argmax()))
            if i < n - 1:
                logits = model(torch.tensor([[out[-1]]]), cache=cache)[:, -1]
        pending = out[-1:]
        outs.append(out)
    return outs


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_multi_turn_on_every_kind(model, kind):
    turn1, turn2 = [7, 3, 9, 11, 2], [40, 41, 42]
    gen = Generator(model, q_config(kind, max_new_tokens=6))
    out1 = gen.run([turn1]).sequences[0]
    out2 = gen.run([turn2]).sequences[0]
    assert gen.cache.length == len(turn1) + 6 + len(turn2) + 6 - 1
    assert [out1, out2] == manual_session(model, CachePolicy.build(kind, qblock=8), [turn1, turn2], 6)


def test_generator_builds_the_configured_policy(model):
    gen = Generator(model, q_config("fp32", cache_policy={"k": "q8_0", "v": "nf4"}, residual_len=3,
                                    cache_fp16_prefix_layers=1, max_new_tokens=3))
    gen.run([[1, 2, 3]])
    first, second = gen.cache.layers
    assert first.k.dtype == torch.float16
    assert second.k_stream.kind is KVCacheKind.Q8_0 and second.v_stream.kind is KVCacheKind.NF4
    assert second.k_stream.R == 3
    with pytest.raises(ValueError, match="unknown stream"):
        GenerateConfig(cache_policy="x=q8_0")


def test_manifest_cache_fields_reach_the_generator():
    from pydantic import ValidationError

    from caramba.manifest import GenerateSettings

    s = GenerateSettings(prompts=["x"], cache_kind="q4", cache_policy={"k": "q8_0"}, qblock=16, residual_len=8,
                         rotate_keys=True, cache_fp16_prefix_layers=2)
    policy = s.engine_config().cache_spec()
    assert policy.to_dict() == {"k": "q8_0", "v": "q4_0", "qblock": 16, "residual_len": 8, "rotate_keys": True,
                                "cache_fp16_prefix_layers": 2}
    for bad in ({"cache_kind": "q3"}, {"cache_policy": {"q": "q8_0"}}, {"qblock": 7}, {"residual_len": -1}):
        with pytest.raises(ValidationError):
            GenerateSettings(prompts=["x"], **bad)


def test_rotate_values_is_an_option_of_the_config_the_cli_and_plans():
    from caramba.autotune.candidates import canonical, default_candidates, policy_from_dict
    from caramba.infer.config import CacheConfig, GenerateConfig

    cfg = GenerateConfig(cache_kind="q4_0l", rotate_keys=True, rotate_values=True)
    policy = cfg.cache.spec()
    assert policy.rotate_values and policy.rotate_keys and policy.describe() == "q4_0l rotate_keys rotate_values"
    assert CacheConfig.of_policy(policy).spec() == policy                # what cache_kind: auto resolves to
    assert policy_from_dict(policy.to_dict()) == canonical(policy)       # how plans store it
    assert any(c.policy.rotate_values for c in default_candidates(make_model()))
    with pytest.raises(ValueError, match="rotate_values"):
        GenerateConfig(cache_kind="auto", rotate_values=True)            # auto chooses it itself
    model = make_model(seed=3)
    out = Generator(model, cfg.replace(max_new_tokens=5, temperature=0.0)).run([[1, 2, 3]])
    assert len(out.sequences[0]) == 5


@pytest.mark.parametrize("kind", [k.value for k in KVCacheKind if k.spec.quantized and not k.spec.per_channel])
@pytest.mark.parametrize("threads", [1, 2])
def test_quantize_on_the_cpu_is_the_torch_reference_bit_for_bit(kind, threads, monkeypatch):
    """The C quantizer (kv_stream.c's quantize_rows: quantize's path for packed kinds) gives the torch
    reference's codes and parameters bit for bit: block-boundary ties, zeros, fp16 subnormal scales,
    values near the fp16 range, a strided input, any thread count; a tensor with a NaN or inf takes
    the reference's path (the same bits as the reference, NaN where it puts NaN)."""
    from caramba.cache import kernel
    from caramba.cache.quant import quantize_reference
    from test_fast_decode import quantizer_inputs

    if kernel.status() != "c":
        pytest.skip(f"no C kernels here: {kernel.status()}")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    spec = KVCacheKind(kind).spec
    x = quantizer_inputs(spec)                                   # [rows, 32]
    wide = torch.randn(2, 3, 40, 64) * torch.logspace(-6, 4, 40)[:, None]
    for xs, block in ((x, 32), (x, 8), (wide, 32), (wide.transpose(1, 2), 16)):
        fast = kernel.quantize_rows(xs, spec, block)
        assert fast is not None, (kind, block)
        ref = quantize_reference(xs, spec, block)
        assert fast[0].dtype == ref[0].dtype and torch.equal(fast[0], ref[0]), (kind, block)
        assert torch.equal(fast[1].view(torch.int16), ref[1].view(torch.int16)), (kind, block)
        assert all(torch.equal(a, b) for a, b in zip(quantize(xs, spec, block), ref))   # whichever path it takes
    for bad in (float("nan"), float("inf")):
        y = wide.clone()
        y[1, 2, 7, 5] = bad
        assert kernel.quantize_rows(y, spec, 32) is None
        got, ref = quantize(y, spec, 32), quantize_reference(y, spec, 32)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1].isnan(), ref[1].isnan())
