"""decode-bench cell measurement on a tiny model."""

from __future__ import annotations

import pytest

from caramba.bench.measure import Cell, measure_caramba, percentile, prompt_batch
from conftest import make_model


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    values = sorted([0.3, 0.1, 0.9, 0.5, 0.7, 0.2])
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_prompt_batch_exact_lengths_and_distinct_rows():
    rows = prompt_batch(list(range(10)), prompt_len=25, batch_size=3)
    assert [len(r) for r in rows] == [25, 25, 25]
    assert rows[0] != rows[1]


def test_measure_caramba_counts_every_token_and_cache_bytes():
    model = make_model()
    cell = Cell(prompt_len=12, batch_size=2, cache_kind="fp32", new_tokens=6)
    result = measure_caramba(model, cell, prompt_batch(list(range(5, 40)), 12, 2), warmup=1, repeats=3)
    assert len(result.ttft_s) == 3 and len(result.token_latency_s) == 3 * 5
    cfg = model.config
    assert result.cache_bytes == cfg.n_layers * 2 * 2 * cfg.n_kv_heads * (12 + 6) * cfg.head_dim * 4
    s = result.summary()
    assert s["decode_p50_ms"] <= s["decode_p90_ms"] <= s["decode_p99_ms"]
    assert s["decode_tok_s"] > 0 and s["prefill_tok_s"] > 0 and s["peak_rss_mb"] > 0


def test_grid_with_hf_reference_gives_ratios():
    from caramba.bench.grid import Grid, run_grid
    from conftest import hf_model

    grid = Grid(prompt_lens=(8, 16), batch_sizes=(1, 2), cache_kinds=("fp32", "fp16"), new_tokens=4, warmup=0, repeats=2)
    rows = run_grid(make_model(), list(range(3, 60)), grid, hf_model=hf_model("llama").eval(), progress=False)
    ours = [r for r in rows if r["impl"] == "caramba"]
    refs = [r for r in rows if r["impl"] == "hf"]
    assert len(ours) == 8 and len(refs) == 2                  # HF: batch 1 only, one cell per length
    with_ratio = [r for r in ours if "decode_tok_s_vs_hf" in r]
    assert len(with_ratio) == 4 and all(r["batch_size"] == 1 for r in with_ratio)
    assert all(r["decode_samples"] == 2 * 3 for r in refs)    # HF streamer timed every decode token
