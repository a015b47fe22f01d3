"""Press methods as one table (caramba.press.spec): a method added as one MethodSpec entry is a
press everywhere -- the press option, parse, the observers, selection, decoding-time compression
and the Generator -- with nothing else edited."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from caramba.infer import GenerateConfig, Generator
from caramba.infer.state import DecodeState
from caramba.options import OptionError
from caramba.infer.pressing import press_masks
from caramba.press import SPECS, MethodSpec, PressConfig
from caramba.press.methods import INF, window_attention
from caramba.press.observe import window_of
from caramba.press.spec import DECODING_METHODS, METHODS
from conftest import make_model
from test_evict import decode, reference_state

PROMPT = 40


def l1_norm(row, press) -> torch.Tensor:
    """A knorm-like throwaway scorer: the smaller the key's L1 norm, the more it matters."""
    return -row.keys.abs().sum(dim=-1)


def last_two(row, press) -> torch.Tensor:
    """A tova-like throwaway scorer over a window of 2 queries (the observers must keep them)."""
    scores = window_attention(row, 2).mean(dim=(0, 1))                         # [L - 2] over heads and queries
    return F.pad(scores, (0, 2), value=INF).expand(row.keys.shape[0], -1)


@pytest.fixture
def model():
    m = make_model(seed=5, n_layers=3, n_heads=4, n_kv_heads=2)
    m.fast_decode = False
    return m


@pytest.fixture
def registered(monkeypatch):
    """The two throwaway methods, each one entry in the table (removed after the test)."""
    monkeypatch.setitem(SPECS, "l1norm", MethodSpec(l1_norm))
    monkeypatch.setitem(SPECS, "last_two", MethodSpec(last_two, window=2, no_decoding="a test's method"))


def prompt(model, n=PROMPT, seed=0):
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_method_is_one_entry_in_the_table(registered):
    assert "l1norm" in METHODS and "l1norm" in DECODING_METHODS and "last_two" not in DECODING_METHODS
    assert PressConfig.parse("l1norm@0.5") == PressConfig(method="l1norm", ratio=0.5)
    assert PressConfig.parse("l1norm@0/8:16").decoding
    assert PressConfig(method="l1norm").min_context() == 1
    assert PressConfig(method="last_two").min_context() == 3 and window_of(PressConfig(method="last_two")) == 2
    with pytest.raises(OptionError, match="last_two: a test's method"):
        PressConfig(method="last_two", interval=8)


def test_the_methods_are_gone_with_their_entry():
    assert "l1norm" not in METHODS
    with pytest.raises(OptionError, match="press='l1norm' must be one of"):
        PressConfig(method="l1norm")


@pytest.mark.parametrize("method", ["l1norm", "last_two"])
def test_a_registered_method_presses_end_to_end(model, registered, method):
    """The Generator with the new method decodes as the full cache with its dropped slots hidden,
    and the kept slots are its scorer's top half per head (a windowed method: its window kept)."""
    ids = prompt(model)
    config = GenerateConfig(max_new_tokens=8, temperature=0.0, max_seq_len=64, press=method, press_ratio=0.5)
    gen = Generator(model, config)
    got = gen.generate(ids)[0, PROMPT:]
    kept = press_masks(model, ids, config.cache.press)
    assert all(int(k.sum()) == 2 * PROMPT // 2 for k in kept)          # 2 KV heads, half of each kept
    if method == "l1norm":
        state = DecodeState(model, model.new_cache(1, 64, "fp32"))
        state.prefill(ids)
        for layer, k in zip(state.cache.layers, kept):
            norms = layer.contents(PROMPT)[0][0].abs().sum(-1)            # [KVH, S]
            want = norms <= norms.kthvalue(PROMPT // 2, dim=-1, keepdim=True).values
            assert torch.equal(k[0], want)
    else:
        assert all(bool(k[0, :, -2:].all()) for k in kept)
    state = DecodeState(model, model.new_cache(1, 64, "fp32"))
    first = state.prefill(ids).argmax(-1)
    ref = reference_state(model, state, kept)
    _, want = decode(ref, first, 7)
    assert got.tolist() == [int(first)] + want[0].tolist()


def test_a_registered_method_compresses_while_decoding(model, registered):
    config = GenerateConfig(max_new_tokens=20, temperature=0.0, max_seq_len=96, press="l1norm", press_ratio=0.0,
                            press_interval=8, press_target=24)
    gen = Generator(model, config)
    gen.generate(prompt(model))
    assert gen.state.cache.length < PROMPT + 20
