"""A cache's bytes at a context length (KVCache.bytes_at), the one count an eval's and a frontier's
byte axis read: every token's codes, plus the full-precision copies a residual window keeps, plus
a hybrid model's rings only up to their capacity. Computed here from the shapes."""

from __future__ import annotations

from caramba.cache import CachePolicy
from conftest import make_model

# tiny model: 2 layers, 2 KV heads of 16: per token and layer, K and V
FP32_SLOT = 2 * 2 * 16 * 4
Q4_0_SLOT = 2 * 2 * (16 // 2 + 2)       # 4-bit codes and an fp16 scale per 16-element block


def test_a_residual_window_is_counted_where_it_is_held():
    model = make_model()
    fp32 = model.new_cache(1, 1, "fp32").bytes_per_token_at(2048)
    assert fp32 == 2 * FP32_SLOT
    plain = model.new_cache(1, 1, "q4_0")
    assert plain.bytes_per_token_at(2048) == 2 * Q4_0_SLOT
    windowed = model.new_cache(1, 1, CachePolicy.build("q4_0", residual_len=128))
    assert windowed.bytes_at(2048) == 2 * (2048 * Q4_0_SLOT + 128 * FP32_SLOT)
    # a window longer than every context: nothing is ever quantized, and it costs more than fp32
    everything = model.new_cache(1, 1, CachePolicy.build("q4_0", residual_len=4096))
    assert everything.bytes_per_token_at(2048) == 2 * (Q4_0_SLOT + FP32_SLOT) > fp32


def test_an_eval_reports_the_residual_window_in_its_bytes():
    from caramba.runners.eval import cache_bytes

    model = make_model()
    row = cache_bytes(model, CachePolicy.build("q4_0", residual_len=4096), 2048)
    assert row["bytes_per_token"] > cache_bytes(model, CachePolicy.build("fp32"), 2048)["bytes_per_token"]
