"""The fused ops (caramba.fused, decode_ops.c) against torch's, a prefill's threaded rows against
a decode step's single ones, and the model's forwards with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from caramba import fused
from caramba.model.rope import apply_rope
import tolerance as tol
from conftest import make_model


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def needs_kernels():
    if fused.library() is None:
        pytest.skip(f"decode kernels {fused.status()}")


def test_ops_equal_torch():
    x, h, w = randn(3, 1, 96, seed=1) * 4, randn(3, 1, 96, seed=2), randn(96, seed=3)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))      # transformers' LlamaRMSNorm
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), ref, **tol.reduction(ref, 96))
    s, y = fused.add_rms_norm(x, h, w, 1e-5)
    assert torch.equal(s, x + h)
    torch.testing.assert_close(y, F.rms_norm(x + h, (96,), w, 1e-5), **tol.reduction(y, 96))
    gu = randn(2, 1, 2 * 40, seed=4) * 3
    ref = F.silu(gu[..., :40]) * gu[..., 40:]
    torch.testing.assert_close(fused.silu_mul(gu, 40), ref, **tol.elementwise(ref, 4))


def test_silu_mul_is_within_a_few_ulp_of_exact_everywhere():
    """decode_ops.c's vector exp (AVX2) and libm's (the scalar tail, portable builds) over the
    whole range a gate meets, element by element against float64: exp's ~2 ulp plus the add,
    divide and multiply stay within a few eps of each value (or 1e-36 absolute: results below
    that, gates under -88, may flush to zero); a wrong coefficient, range reduction or exponent
    would be off by 1e-4 or more somewhere."""
    g = torch.cat([torch.linspace(-110, 110, 4001), randn(995, seed=5) * 4])   # 8k + 4: vectors and a tail
    u = randn(g.numel(), seed=6)
    got = fused.silu_mul(torch.cat([g, u]).reshape(1, 1, -1), g.numel()).flatten().double()
    exact = g.double() * torch.sigmoid(g.double()) * u.double()
    err = (got - exact).abs()
    assert (err <= 8 * torch.finfo(torch.float32).eps * exact.abs() + 1e-36).all(), float((err / exact.abs()).max())


def test_silu_mul_and_its_reference_agree_within_their_bounds():
    """silu_mul (exp8, 8 at a time, with the reference's tail) against silu_mul_ref (libm's expf,
    one at a time; what a build without AVX2 runs): each is within 8 eps of the exact value, so
    they are within 16 eps of each other, at every width (vectors and tails)."""
    lib = fused.library()
    eps = torch.finfo(torch.float32).eps
    for hidden in (1, 7, 8, 13, 64, 200):
        g = torch.cat([torch.linspace(-90, 90, 3 * hidden), randn(hidden, seed=hidden) * 5])
        rows = g.numel() // hidden
        gu = torch.cat([g.reshape(rows, hidden), randn(rows, hidden, seed=7)], 1).contiguous()
        got, ref = torch.empty(rows, hidden), torch.empty(rows, hidden)
        lib.silu_mul(gu.data_ptr(), got.data_ptr(), rows, hidden)
        lib.silu_mul_ref(gu.data_ptr(), ref.data_ptr(), rows, hidden)
        gd, ud = gu[:, :hidden].double(), gu[:, hidden:].double()
        exact = gd * torch.sigmoid(gd) * ud
        assert ((ref.double() - exact).abs() <= 8 * eps * exact.abs() + 1e-36).all(), hidden
        assert ((got.double() - ref.double()).abs() <= 16 * eps * exact.abs() + 2e-36).all(), hidden
        tail = hidden - hidden % 8
        assert torch.equal(got[:, tail:], ref[:, tail:]), "the vector loop's tail is the reference"


def test_applies_only_to_fp32_cpu_inference():
    assert fused.applies(torch.zeros(1, 1, 64))
    assert fused.applies(torch.zeros(1, 600, 64))                             # a prefill's rows too
    assert not fused.applies(torch.zeros(1, 1, 64, dtype=torch.bfloat16))
    assert not fused.applies(torch.zeros(1, 1, 64, requires_grad=True))
    assert not fused.applies(torch.zeros(1, 64, 2).transpose(1, 2))           # not contiguous


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_prefills_rows_are_each_rows_bits_alone(threads, monkeypatch):
    """Over SERIAL_ROWS rows the ops split the rows over threads; each row's result is the bits the
    same row gets alone (a decode step's call): a prompt rounds the same fed whole or in chunks."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rows, dim, hidden = fused.SERIAL_ROWS * 4 + 3, 96, 40
    x, h, w = randn(1, rows, dim, seed=1) * 3, randn(1, rows, dim, seed=2), randn(dim, seed=3)
    gu = randn(1, rows, 2 * hidden, seed=4) * 3
    many = [fused.rms_norm(x, w, 1e-5), *fused.add_rms_norm(x, h, w, 1e-5), fused.silu_mul(gu, hidden),
            fused.gelu_mul(gu, hidden)]
    for r in range(rows):
        one = [fused.rms_norm(x[:, r:r + 1], w, 1e-5), *fused.add_rms_norm(x[:, r:r + 1], h[:, r:r + 1], w, 1e-5),
               fused.silu_mul(gu[:, r:r + 1], hidden), fused.gelu_mul(gu[:, r:r + 1], hidden)]
        for got, want in zip(many, one):
            assert torch.equal(got[:, r:r + 1], want), r


@pytest.mark.parametrize("B,T,heads,kv,D", [(1, 40, 9, 3, 64), (2, 17, 4, 2, 16), (1, 5, 2, 1, 8)])
def test_rope_heads_is_apply_rope_within_a_rounding(B, T, heads, kv, D):
    """RoPE of a projection's q and k heads in one pass: x cos + roll(x) signed_sin, each element
    two products and a sum (a fused multiply-add may take one rounding less), against torch's three
    ops; the v heads after them are left out, and the result is laid out [B, T, heads, D]."""
    from caramba.model.config import ModelConfig
    from caramba.model.rope import RotaryTable
    cfg = ModelConfig(vocab_size=16, dim=heads * D, n_layers=1, n_heads=heads, n_kv_heads=kv, head_dim=D,
                      intermediate_size=8, max_position_embeddings=64)
    qkv = randn(B, T, (heads + 2 * kv) * D, seed=5) * 2
    positions = torch.arange(3, 3 + T).expand(B, T)
    cos, sin = RotaryTable(cfg, 64)(positions, torch.float32)
    assert fused.rope_applies(qkv, cos)
    got = fused.rope_heads(qkv, cos, sin, heads + kv)
    view = qkv.view(B, T, heads + 2 * kv, D).transpose(1, 2)[:, :heads + kv]
    want = apply_rope(view, cos, sin)
    assert got.shape == want.shape == (B, heads + kv, T, D)
    assert got.transpose(1, 2).is_contiguous()
    bound = 2 * 2.0 ** -24 * (view.abs() * cos.abs() + view.roll(D // 2, -1).abs() * sin.abs())   # two roundings
    assert ((got - want).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("padded", [False, True])
def test_causal_softmax_is_torchs_masked_softmax(padded):
    """A block of n queries, rep rows each (row i: query i // rep), query t seeing keys [0, first +
    t] (and, padded, only those its mask row allows): torch's softmax over the scores with every
    hidden key at -inf, within the exp's few ulp; the hidden keys' probabilities are exactly 0."""
    n, rep, first = 37, 3, 50
    end = first + n
    scores = randn(n * rep, end, seed=8) * 4
    seen = torch.ones(n, end, dtype=torch.bool).tril(first)
    mask = None
    if padded:
        mask = seen.clone()
        mask[:, :7] = False                      # left padding: 7 slots no query sees
        seen = mask
    want = torch.softmax(scores.masked_fill(~seen.repeat_interleave(rep, 0), float("-inf")), -1)
    got = fused.causal_softmax(scores.clone(), rep, first, mask)
    assert torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, **tol.elementwise(want, 8))


def test_decode_steps_equal_the_unfused_model(monkeypatch):
    model = make_model(seed=2)         # its own forward: the torch path's steps, where these ops are used
    ids = torch.tensor([[5, 9, 1, 44, 3]])

    def steps():
        with torch.inference_mode():
            cache = model.new_cache(1, 32)
            out = [model(ids, cache=cache)]
            for t in (7, 8, 9):
                out.append(model(torch.tensor([[t]]), cache=cache))
        return torch.cat(out, dim=1)

    got = steps()
    monkeypatch.setattr(fused, "applies", lambda x: False)
    ref = steps()
    torch.testing.assert_close(got, ref, **tol.forward(ref, model.config))


def test_a_prefill_equals_the_unfused_model(monkeypatch):
    """A prompt of 70 tokens (over SERIAL_ROWS: the threaded rows, RoPE in one pass) against
    torch's ops."""
    model = make_model(seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))

    def prefill():
        with torch.inference_mode():
            return model(ids, cache=model.new_cache(2, 80))

    got = prefill()
    monkeypatch.setattr(fused, "applies", lambda x: False)
    monkeypatch.setattr(fused, "rope_applies", lambda *a: False)
    ref = prefill()
    torch.testing.assert_close(got, ref, **tol.forward(ref, model.config))


def test_gelu_mul_and_its_reference_are_within_their_bounds_of_exact():
    """GeGLU's gate (Gemma: tanh GELU) shares silu_mul's exp with the argument z = -2 sqrt(2/pi)
    (g + 0.044715 g^3): z carries a few roundings, which exp turns into a relative error of a few
    eps times |z|; so each path is within (8 + 4 |z|) eps of the exact value, and the vector loop's
    tail is the reference. A wrong coefficient would be off by 1e-3 or more somewhere."""
    lib = fused.library()
    eps = torch.finfo(torch.float32).eps
    for hidden in (1, 7, 8, 13, 64, 200):
        g = torch.cat([torch.linspace(-12, 12, 3 * hidden), randn(hidden, seed=hidden) * 3])
        rows = g.numel() // hidden
        gu = torch.cat([g.reshape(rows, hidden), randn(rows, hidden, seed=7)], 1).contiguous()
        got, ref = torch.empty(rows, hidden), torch.empty(rows, hidden)
        lib.gelu_mul(gu.data_ptr(), got.data_ptr(), rows, hidden)
        lib.gelu_mul_ref(gu.data_ptr(), ref.data_ptr(), rows, hidden)
        gd, ud = gu[:, :hidden].double(), gu[:, hidden:].double()
        inner = (2 / torch.pi) ** 0.5 * (gd + 0.044715 * gd ** 3)
        exact = gd / (1 + torch.exp(-2 * inner)) * ud    # = g (1 + tanh(inner)) / 2, without its cancellation
        bound = (8 + 8 * inner.abs()) * eps * exact.abs() + 1e-30
        assert ((ref.double() - exact).abs() <= bound).all(), hidden
        assert ((got.double() - exact).abs() <= bound).all(), hidden
        tail = hidden - hidden % 8
        assert torch.equal(got[:, tail:], ref[:, tail:]), "the vector loop's tail is the reference"
    gu = randn(2, 1, 2 * 40, seed=4) * 3
    want = F.gelu(gu[..., :40], approximate="tanh") * gu[..., 40:]
    torch.testing.assert_close(fused.gelu_mul(gu, 40), want, **tol.elementwise(want, 8))
