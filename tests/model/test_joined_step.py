"""The joined fused C step (decode_step.c's decode_step_joined, fast_decode.step_joined): several
caches' rows in one C call, the projections, MLP and head over all of them at once and each
layer's attention per cache. Against each state's own C step (the same logits up to the rounding
of a product over more rows, the same greedy tokens, the same caches up to a storage step), bit for
bit against one C step of a single cache holding the same rows, and one segment bit for bit the
plain step; caches the C step does not take fall back to the torch join."""

from __future__ import annotations

import pytest
import torch

import tolerance as tol
from caramba.cache import CachePolicy
from caramba.evaluation.joined import step_together
from caramba.infer.state import DecodeState
from caramba.model import fast_decode
from caramba.model.backend import CStep
from conftest import make_model

# name -> CachePolicy.build keywords: every stream kind the C step reads, windows, rotations, groups
POLICIES = {
    "fp32": dict(kind="fp32"),
    "q8_0": dict(kind="q8_0", qblock=8),
    "q4_0": dict(kind="q4_0", qblock=8),
    "q4_1": dict(kind="q4_1", qblock=8),
    "nf4": dict(kind="nf4", qblock=8),
    "q2_1 residual_len=2": dict(kind="q2_1", qblock=8, residual_len=2),
    "q4_0l": dict(kind="q4_0l", qblock=4),
    "q4_0l rotated": dict(kind="q4_0l", qblock=4, rotate_keys=True, rotate_values=True),
    "fp32 rotated": dict(kind="fp32", rotate_keys=True, rotate_values=True),
    "q8_0 residual_len=4": dict(kind="q8_0", residual_len=4),
    "k=q4_1c,v=q4_1 qblock=4": dict(kind="q4_1", policy="k=q4_1c", qblock=4),
    "fp16": dict(kind="fp16"),
    "bf16": dict(kind="bf16"),
}


@pytest.fixture(autouse=True)
def needs_kernels():
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")


@pytest.fixture
def joined_calls(monkeypatch):
    """The joined C steps taken (fast_decode.step_joined), one entry each: its calls' rows."""
    calls, real = [], fast_decode.step_joined

    def counting(model, got, **kw):
        calls.append([c[0].shape[0] for c in got])
        return real(model, got, **kw)

    monkeypatch.setattr(fast_decode, "step_joined", counting)
    return calls


def _state(model, backend, name: str, batch: int, length: int, seed: int, holes: bool = True) -> DecodeState:
    """A state of `batch` rows prefilled with `length` tokens (with holes: row 1 left-padded by 3)."""
    ids = torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, length, dtype=torch.bool)
    if batch > 1 and holes:
        mask[1, :3] = False
    state = DecodeState(model, model.new_cache(batch, length + 16, CachePolicy.build(**POLICIES[name])),
                        backend=backend)
    state.prefill(ids, None if bool(mask.all()) else mask)
    return state


# (policy, batch, context length): different lengths (across ATT_PART's 64 slots), batches, holes
MIXED = [("q8_0", 1, 70), ("q4_0", 2, 9), ("q4_1", 1, 33), ("nf4", 3, 12), ("fp32", 2, 65), ("q2_1 residual_len=2", 1, 20),
         ("q4_0l", 1, 5), ("q4_0l rotated", 2, 40), ("fp32 rotated", 1, 17), ("q8_0 residual_len=4", 2, 30),
         ("k=q4_1c,v=q4_1 qblock=4", 1, 21), ("fp16", 2, 25), ("bf16", 1, 50)]


def _assert_caches_close(alone: DecodeState, joined: DecodeState, name: str, config) -> None:
    """The same bookkeeping; every stream reads back the same up to one storage step."""
    assert alone.cache.length == joined.cache.length and torch.equal(alone.next_pos, joined.next_pos)
    assert (alone.slot_mask is None) == (joined.slot_mask is None)
    assert alone.slot_mask is None or torch.equal(alone.slot_mask, joined.slot_mask)
    for a, b in zip(alone.cache.layers, joined.cache.layers):
        for s_a, s_b in ((a.k_stream, b.k_stream), (a.v_stream, b.v_stream)):
            want = s_a.read(a.length, torch.float32)
            torch.testing.assert_close(s_b.read(b.length, torch.float32), want,
                                       **tol.cache_paths(want, config, s_a.cfg.kind.value))
            assert getattr(s_a, "fp_lo", None) == getattr(s_b, "fp_lo", None), name


@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_joined_steps_equal_each_states_own_c_step(threads, joined_calls):
    """Thirteen states of mixed kinds, lengths, batches and holes: each row's logits within a storage
    step of its state's own C step (the new K and V come from a product over more rows, so a code
    may land a step away), greedy tokens equal, caches alike; the joined path taken every step."""
    model = make_model(seed=21)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=threads))
    alone = [_state(model, backend, n, b, t, i) for i, (n, b, t) in enumerate(MIXED)]
    joined = [_state(model, backend, n, b, t, i) for i, (n, b, t) in enumerate(MIXED)]
    tokens = [torch.full((b,), 7 + i) for i, (_, b, _) in enumerate(MIXED)]
    masks = [None if b == 1 else torch.tensor([True, False] + [True] * (b - 2)) for _, b, _ in MIXED]
    torch_steps = backend.steps["torch"]      # the prefills'
    for _ in range(6):      # past a per-channel group (qblock 4) and the residual windows
        want = [s.step(t, m) for s, t, m in zip(alone, tokens, masks)]
        got = step_together(model, joined, tokens, masks)
        for (name, _, _), w, g in zip(MIXED, want, got):
            kind = max((c.kind.value for c in (CachePolicy.build(**POLICIES[name]).k,
                                               CachePolicy.build(**POLICIES[name]).v)), key=tol.STORAGE_STEP.get)
            torch.testing.assert_close(g, w, **tol.cache_paths(w, model.config, kind))
            assert torch.equal(g.argmax(-1), w.argmax(-1)), name
        tokens = [w.argmax(-1) for w in want]
    assert joined_calls == [[b for _, b, _ in MIXED]] * 6 and backend.steps["torch"] == torch_steps
    for (name, _, _), a, j in zip(MIXED, alone, joined):
        _assert_caches_close(a, j, name, model.config)


@torch.inference_mode()
def test_with_exact_rows_joined_steps_are_each_states_own_bit_for_bit(joined_calls):
    """CStep(exact_rows=True): a row's products are summed the same way in every batch, one row
    included, so the thirteen mixed states' joined logits and caches are each state's own C step's,
    bit for bit (without it a one-row state's fp32 [N, K] products take dot_f32: test above)."""
    model = make_model(seed=21)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=2), exact_rows=True)
    alone = [_state(model, backend, n, b, t, i) for i, (n, b, t) in enumerate(MIXED)]
    joined = [_state(model, backend, n, b, t, i) for i, (n, b, t) in enumerate(MIXED)]
    tokens = [torch.full((b,), 7 + i) for i, (_, b, _) in enumerate(MIXED)]
    masks = [None if b == 1 else torch.tensor([True, False] + [True] * (b - 2)) for _, b, _ in MIXED]
    for _ in range(6):
        want = [s.step(t, m) for s, t, m in zip(alone, tokens, masks)]
        got = step_together(model, joined, tokens, masks)
        for (name, _, _), w, g in zip(MIXED, want, got):
            assert torch.equal(g, w), name
        tokens = [w.argmax(-1) for w in want]
    assert joined_calls == [[b for _, b, _ in MIXED]] * 6
    for (name, _, _), a, j in zip(MIXED, alone, joined):
        assert torch.equal(a.next_pos, j.next_pos) and a.cache.length == j.cache.length
        for x, y in zip(_streams(a.cache), _streams(j.cache)):
            assert torch.equal(x, y), name


@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_a_hybrid_models_rings_join(threads, joined_calls):
    """A hybrid model's caches (sliding layers' rings, some wrapped, with their own masks and RoPE
    base) of several kinds and lengths, joined: each state's own C step up to rounding."""
    from caramba.model.transformer import Transformer
    from conftest import init_weights_, tiny_config

    cfg = tiny_config(n_layers=4, sliding_window=8, layer_types=["sliding", "sliding", "full", "sliding"],
                      rope_local_theta=100.0)
    model = init_weights_(Transformer(cfg), seed=28).eval().requires_grad_(False)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=threads))
    mixed = [("fp32", 2, 20), ("q8_0", 1, 5), ("q4_0l rotated", 2, 7), ("nf4", 1, 40), ("bf16", 1, 12)]
    alone = [_state(model, backend, n, b, t, i) for i, (n, b, t) in enumerate(mixed)]
    joined = [_state(model, backend, n, b, t, i) for i, (n, b, t) in enumerate(mixed)]
    tokens = [torch.full((b,), 9 + i) for i, (_, b, _) in enumerate(mixed)]
    for _ in range(5):      # the short ones' rings wrap
        want = [s.step(t) for s, t in zip(alone, tokens)]
        got = step_together(model, joined, tokens, [None] * len(mixed))
        for (name, _, _), w, g in zip(mixed, want, got):
            torch.testing.assert_close(g, w, **tol.cache_paths(w, model.config, POLICIES[name]["kind"]))
            assert torch.equal(g.argmax(-1), w.argmax(-1)), name
        tokens = [w.argmax(-1) for w in want]
    assert len(joined_calls) == 5
    for a, j in zip(alone, joined):
        assert a.cache.length == j.cache.length and torch.equal(a.next_pos, j.next_pos)


def _split_rows(model, name: str, ids: torch.Tensor) -> tuple:
    """A cache of every row of ids and one cache per row, each holding the same codes: an fp32
    prefill's contents written into each (per-token and per-channel codes are each row's own)."""
    B, T = ids.shape
    policy = CachePolicy.build(**POLICIES[name])
    base = model.new_cache(B, T + 8, "fp32")
    model(ids, cache=base)
    whole, rows = model.new_cache(B, T + 8, policy), [model.new_cache(1, T + 8, policy) for _ in range(B)]
    for i, layer in enumerate(base.layers):
        k, v = layer.contents(T)
        whole.layers[i].extend(k, v)
        for r, cache in enumerate(rows):
            cache.layers[i].extend(k[r : r + 1], v[r : r + 1])
    return whole, rows


def _streams(cache, row: int | None = None) -> list[torch.Tensor]:
    """Every tensor a cache's streams hold (one row's), to compare bit for bit."""
    out = []
    for layer in cache.layers:
        for s in (layer.k_stream, layer.v_stream):
            for name in ("data", "codes", "scales", "ring"):
                t = getattr(s, name, None)
                if isinstance(t, torch.Tensor):
                    out.append(t if row is None else t[row : row + 1])
            out.append(s.read(layer.length, torch.float32) if row is None else s.read(layer.length, torch.float32)[row : row + 1])
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["q8_0", "k=q4_1c,v=q4_1 qblock=4", "q2_1 residual_len=2"])
@torch.inference_mode()
def test_a_joined_call_of_one_kind_is_one_cache_step_bit_for_bit(name, threads):
    """Three one-row caches joined against one three-row cache of the same codes: the products see
    the same three rows, the attention the same caches, so the same bits, logits and codes."""
    model = make_model(seed=22)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=threads))
    ids = torch.randint(0, 97, (3, 66), generator=torch.Generator().manual_seed(23))
    whole, rows = _split_rows(model, name, ids)
    tok = torch.tensor([[5], [40], [90]])
    for step in range(5):
        pos = torch.full((3, 1), 66 + step)
        want = backend(tok, pos, whole, None, last_only=True)[:, -1]
        got = backend.step_joined([(tok[r : r + 1], pos[r : r + 1], rows[r], None) for r in range(3)])
        assert got is not None and torch.equal(torch.cat(got), want), step
        tok = want.argmax(-1, keepdim=True)
    for r, cache in enumerate(rows):
        assert cache.length == whole.length
        for a, b in zip(_streams(cache), _streams(whole, r)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["nf4", "q4_0l rotated", "k=q4_1c,v=q4_1 qblock=4"])
@torch.inference_mode()
def test_one_segment_is_the_plain_step_bit_for_bit(name, joined_calls):
    """step_together of one state: a joined call of one segment, decode_step's bits and cache. (Rows
    whose per-channel groups start at different slots, holes, take the torch path: none here.)"""
    model = make_model(seed=24)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=2))
    holes = "q4_1c" not in name
    alone, joined = (_state(model, backend, name, 2, 30, 25, holes) for _ in range(2))
    tokens, mask = torch.tensor([3, 4]), torch.tensor([True, False])
    for _ in range(5):
        want = alone.step(tokens, mask)
        (got,) = step_together(model, [joined], [tokens], [mask])
        assert torch.equal(got, want)
        tokens = want.argmax(-1)
    assert len(joined_calls) == 5
    assert torch.equal(alone.next_pos, joined.next_pos) and alone.cache.length == joined.cache.length
    for a, b in zip(_streams(alone.cache), _streams(joined.cache)):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_a_cache_the_c_step_refuses_joins_through_torch(joined_calls):
    """A cache with per-channel values (the C step reads none) in the join: the C step joins the
    others and the torch forward steps it, each state's logits those of its own step up to rounding;
    without it the C step joins the rest."""
    model = make_model(seed=26)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=1))
    names = ["q8_0", "fp32"]

    def states():
        out = [_state(model, backend, n, 2, 12, i) for i, n in enumerate(names)]
        refused = DecodeState(model, model.new_cache(1, 30, CachePolicy.build("fp32", "v=q4_1c", qblock=4)),
                              backend=backend)
        refused.prefill(torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(27)))
        return out + [refused]

    alone, joined = states(), states()
    tokens = [torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([7])]
    want = [s.step(t) for s, t in zip(alone, tokens)]
    got = step_together(model, joined, tokens, [None] * 3)
    assert joined_calls == [[2, 2]]     # the two it takes joined in C, the refused one alone in torch
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, **tol.cache_paths(w, model.config, "q4_1c"))
    got = step_together(model, joined[:2], [w.argmax(-1) for w in want[:2]], [None] * 2)
    assert joined_calls == [[2, 2], [2, 2]]     # up to JOIN_MEAN_ROWS a cache: joined in C
    want = [s.step(w.argmax(-1)) for s, w in zip(alone[:2], want[:2])]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, **tol.cache_paths(w, model.config, "q8_0"))


@torch.inference_mode()
def test_segments_that_disagree_are_refused(monkeypatch):
    """decode_step_joined takes segments of one model, one token a row, logits one after another:
    a segment of two tokens a row, another model's shapes or layers, logits elsewhere, or no
    segment at all is refused (code 2) before anything is computed; the same call as it was then
    steps as before."""
    import ctypes

    from caramba.model.step_abi import StepArgs

    model = make_model(seed=29)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=1))
    states = [_state(model, backend, n, 1, 10, i) for i, n in enumerate(["q8_0", "fp32"])]
    lib, codes = fast_decode.library(), []

    class Probe:
        def decode_step_joined(self, segs, n):
            for field, change in (("T", 1), ("n_heads", 1), ("dim", 1), ("layers", 8), ("logits", 4)):
                bad = (StepArgs * n)()
                ctypes.memmove(bad, segs, ctypes.sizeof(segs))
                setattr(bad[1], field, getattr(bad[1], field) + change)
                codes.append(lib.decode_step_joined(bad, n))
            codes.append(lib.decode_step_joined(segs, 0))
            return lib.decode_step_joined(segs, n)

    monkeypatch.setattr(fast_decode, "library", lambda: Probe())
    got = step_together(model, states, [torch.tensor([3]), torch.tensor([4])], [None, None])
    assert codes == [2] * 6 and all(torch.isfinite(g).all() for g in got)


@torch.inference_mode()
def test_more_rows_than_a_joined_c_step_takes_join_through_torch(joined_calls):
    """Past JOIN_MEAN_ROWS rows a cache on average (or JOIN_MAX_ROWS in all) the torch join wins:
    two caches of JOIN_MEAN_ROWS + 1 rows join through it, each state's logits its own step's up to rounding."""
    model = make_model(seed=30)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=1))
    B = fast_decode.JOIN_MEAN_ROWS + 1
    alone, joined = ([_state(model, backend, n, B, 12, i) for i, n in enumerate(["q4_0", "fp32"])] for _ in range(2))
    tokens = [torch.arange(3, 3 + B), torch.arange(20, 20 + B)]
    want = [s.step(t) for s, t in zip(alone, tokens)]
    got = step_together(model, joined, tokens, [None] * 2)
    assert joined_calls == []
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, **tol.cache_paths(w, model.config, "q4_0"))


# every kind a stepwise chunk takes (no ring, residual window or per-channel group), and some it refuses
STEPWISE = ["fp32", "q8_0", "q4_0", "q4_1", "nf4", "q4_0l", "q4_0l rotated", "fp32 rotated", "fp16", "bf16"]
NOT_STEPWISE = ["q2_1 residual_len=2", "q8_0 residual_len=4", "k=q4_1c,v=q4_1 qblock=4"]


def _prefilled(model, backend, name: str, length: int, seed: int):
    ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))
    cache = model.new_cache(1, length + 40, CachePolicy.build(**POLICIES[name]))
    backend(ids, cache=cache)
    return cache


@pytest.mark.parametrize("level", ["scalar", "native"])
@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_a_stepwise_chunk_is_its_steps_bit_for_bit(threads, level, monkeypatch):
    """CStep.step_joined(stepwise=True) with exact rows: T tokens of a cache's row in one C call give
    each token's logits, and the cache, bit for bit as T one-token steps, alone and joined with
    every other kind it takes, across the attention's 64-slot parts and 8-slot SIMD runs (contexts
    of 5, 57 and 100 tokens, chunks of 16, 3 and 1); caches it refuses are None and unwritten. A
    plain chunk (no stepwise) reads its own new tokens otherwise: other logits."""
    from caramba.model import isa

    if level == "native":
        level = isa.resolve("avx512")
    model = make_model(seed=22, std=0.1)
    backend = CStep(model, fast_decode.ThreadChoice(fixed=threads), exact_rows=True)
    ids = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(9))
    with isa.use_isa(level):
        for length in (5, 57, 100):
            steps = {n: _prefilled(model, backend, n, length, i) for i, n in enumerate(STEPWISE)}
            alone = {n: _prefilled(model, backend, n, length, i) for i, n in enumerate(STEPWISE)}
            joined = {n: _prefilled(model, backend, n, length, i) for i, n in enumerate(STEPWISE)}
            plain = _prefilled(model, backend, "q4_0", length, STEPWISE.index("q4_0"))
            at = 0
            for T in (16, 3):
                chunk = ids[:, at : at + T]
                want = {n: torch.cat([backend(chunk[:, k : k + 1], cache=c)[:, -1] for k in range(T)])
                        for n, c in steps.items()}
                for n, c in alone.items():
                    (got,) = backend.step_joined([(chunk, None, c, None)], stepwise=True)
                    assert got.shape == (1, T, model.config.vocab_size) and torch.equal(got[0], want[n]), (n, length, T)
                got = backend.step_joined([(chunk, None, c, None) for c in joined.values()], stepwise=True)
                for n, g in zip(joined, got):
                    assert torch.equal(g[0], want[n]), (n, length, T)
                if T > 1:
                    assert not torch.equal(backend(chunk, cache=plain)[0], want["q4_0"]), length
                at += T
            for n in STEPWISE:
                for x, y, z in zip(_streams(steps[n]), _streams(alone[n]), _streams(joined[n])):
                    assert torch.equal(x, y) and torch.equal(x, z), (n, length)
    refused = {n: _prefilled(model, backend, n, 20, i) for i, n in enumerate(NOT_STEPWISE)}
    taken = _prefilled(model, backend, "q4_0", 20, 0)
    got = backend.step_joined([(ids[:, :4], None, c, None) for c in (*refused.values(), taken)], partial=True,
                              stepwise=True)
    assert got[:3] == [None] * 3 and got[3].shape == (1, 4, model.config.vocab_size)
    assert all(c.length == 20 for c in refused.values()) and taken.length == 24
    assert backend.step_joined([(ids[:, :4], None, c, None) for c in refused.values()], stepwise=True) is None


@pytest.mark.parametrize("fmt,act", [("q8_0", "q8"), ("q4_0", "q8"), ("q8_0", "i16")])
@torch.inference_mode()
def test_a_stepwise_chunk_of_quantized_weights_is_its_steps_bit_for_bit(fmt, act):
    """The block formats' products quantize each row's activations on their own, so a stepwise
    chunk through quantized weights is its steps bit for bit too (a weight-format study's lockstep)."""
    from caramba.model.quant import quantize_model

    model = make_model(seed=23, std=0.1)
    assert quantize_model(model, fmt, act) > 0
    backend = CStep(model, fast_decode.ThreadChoice(fixed=2), exact_rows=True)
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(4))
    steps, chunked = (_prefilled(model, backend, "q4_0", 60, 1) for _ in range(2))
    want = torch.cat([backend(ids[:, k : k + 1], cache=steps)[:, -1] for k in range(16)])
    (got,) = backend.step_joined([(ids, None, chunked, None)], stepwise=True)
    assert torch.equal(got[0], want)
    for x, y in zip(_streams(steps), _streams(chunked)):
        assert torch.equal(x, y)
