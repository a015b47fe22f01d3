"""caramba.model.arena: a model's weights moved into one anonymous mapping keep their values,
their sharing and the model's outputs bit for bit, and the C step reads them there."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch
from torch import nn

from caramba.model import arena, fast_decode, quant
from conftest import make_model


def tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def in_one_mapping(module: nn.Module, size: int) -> bool:
    """Every tensor's bytes lie in one range of `size` bytes starting on a page: the arena."""
    ptrs = [t.untyped_storage().data_ptr() for t in tensors(module)]
    base = min(ptrs)
    return base % mmap.PAGESIZE == 0 and all(
        base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + size for t in tensors(module))


@torch.inference_mode()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 4)
    out = [model(ids, cache=cache)[:, -1]]
    for t in (3, 5, 7):
        out.append(model(torch.full((ids.shape[0], 1), t), cache=cache)[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("weights", ["fp32", "q8_0", "q4_0"])
def test_placed_weights_give_the_same_bits_from_one_mapping(weights):
    model = make_model(seed=3)
    if weights != "fp32":
        quant.quantize_model(model, weights)
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    want = logits(model, ids)
    size = arena.place(model)
    assert size >= sum(t.numel() * t.element_size() for t in before.values())
    assert in_one_mapping(model, size)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    assert torch.equal(logits(model, ids), want)


def test_tensors_sharing_a_storage_still_share_it():
    """Tied weights (two parameters viewing one storage, at offsets and strides) are copied once
    and stay views of the same bytes."""
    m = nn.Module()
    base = torch.arange(48, dtype=torch.float32)
    m.a = nn.Parameter(base[4:28].view(4, 6), requires_grad=False)
    m.b = nn.Parameter(base[10:40].view(6, 5).t(), requires_grad=False)   # overlapping, transposed
    m.register_buffer("c", torch.arange(7, dtype=torch.int16))
    want = (m.a.clone(), m.b.clone(), m.c.clone())
    assert arena.place(m) > 0
    assert m.a.untyped_storage().data_ptr() == m.b.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert m.b.stride() == (1, 5)
    assert torch.equal(m.a, want[0]) and torch.equal(m.b, want[1]) and torch.equal(m.c, want[2])
    with torch.no_grad():
        m.a[1, 0] = -1.0   # still one set of bytes: the storage's element 10 is a[1, 0] and b[0, 0]
    assert m.b[0, 0] == -1.0


def test_the_switch_leaves_the_weights_where_they_were(monkeypatch):
    model = make_model(seed=5)
    ptrs = [t.data_ptr() for t in tensors(model)]
    monkeypatch.setenv(arena.ENV, "0")
    assert arena.place(model) == 0
    assert [t.data_ptr() for t in tensors(model)] == ptrs


def test_the_c_step_reads_the_placed_weights():
    """The decode step's plan takes the weights' addresses after place(): its logits equal the
    torch path's on the placed model (and so the model's own, bit for bit above)."""
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    from test_fast_decode import assert_same, run_both

    model = make_model(seed=6)
    arena.place(model)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(7))
    ref, got = run_both(model, ids, list(range(7, 13)))
    assert_same(ref, got, model.config)
    plan = fast_decode._Plan(model)
    assert ctypes.c_void_p(plan.head.w).value == model.head.weight_t.data_ptr()
