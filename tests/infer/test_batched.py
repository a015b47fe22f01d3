"""generate_batched: length-sorted batches, input-order results, and batch_size="auto"."""

from __future__ import annotations

import pytest
import torch

from caramba.infer import GenerateConfig, Generator
from caramba.infer.batched import auto_batch_size, generate_batched, row_cost_bytes


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]


def test_results_in_input_order_equal_each_prompt_alone(model):
    prompts = _prompts([3, 9, 1, 6, 4, 7, 2])
    kw = dict(max_new_tokens=6, temperature=0, eos_token_id=[], max_seq_len=64)
    out = generate_batched(model, prompts, batch_size=3, **kw)
    assert out.batch_size == 3 and out.sizing is None
    assert out.batches == [[1, 5, 3], [4, 0, 6], [2]]   # longest first, ties in input order
    for i, p in enumerate(prompts):
        alone = Generator(model, GenerateConfig(**kw)).run([p])
        assert out.sequences[i] == alone.sequences[0]
        assert out.finish_reasons[i] == alone.finish_reasons[0]
    assert out.n_generated == 6 * len(prompts)


def test_eos_finish_reasons_follow_their_prompt(model):
    prompts = _prompts([5, 2, 8])
    free = generate_batched(model, prompts, batch_size=2, max_new_tokens=6, temperature=0, eos_token_id=[], max_seq_len=32)
    eos = free.sequences[1][2]
    out = generate_batched(model, prompts, batch_size=2, max_new_tokens=6, temperature=0, eos_token_id=eos, max_seq_len=32)
    assert out.sequences[1] == free.sequences[1][:3] and out.finish_reasons[1] == "eos"


@pytest.mark.parametrize("kind", ["fp32", "fp16", "q8_0", "q4_0"])
def test_row_cost_counts_the_cache_the_generator_allocates(model, kind):
    cfg = GenerateConfig(max_seq_len=48, cache_kind=kind)
    cost = row_cost_bytes(model, cfg, prompt_len=10)
    assert cost["cache_bytes"] == model.new_cache(1, 48, cfg.cache_spec()).nbytes
    assert cost["total"] == cost["cache_bytes"] + cost["activation_bytes"] > cost["cache_bytes"]


def test_auto_sizes_from_free_memory(model):
    prompts = _prompts([4, 6, 3, 5, 2])
    cfg = GenerateConfig(max_new_tokens=3, temperature=0, eos_token_id=[], max_seq_len=32)
    row = row_cost_bytes(model, cfg, 6)["total"]
    size, why = auto_batch_size(model, cfg, 6, len(prompts), free_bytes=int(2 * row / 0.5) + 1)
    assert size == 2 and why["limited_by"] == "memory" and why["row_bytes"]["total"] == row
    out = generate_batched(model, prompts, "auto", cfg, free_bytes=int(2 * row / 0.5) + 1)
    assert out.batch_size == 2 and out.sizing["chosen"] == 2 and len(out.batches) == 3
    tiny = generate_batched(model, prompts, "auto", cfg, free_bytes=1)
    assert tiny.batch_size == 1 and tiny.sequences == out.sequences
    measured = generate_batched(model, prompts, "auto", cfg)   # this machine's free memory
    assert measured.batch_size == len(prompts) and measured.sizing["limited_by"] == "all prompts"


def test_bad_batch_size(model):
    with pytest.raises(ValueError, match="batch_size"):
        generate_batched(model, [[1, 2]], batch_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        generate_batched(model, [[1, 2]], batch_size="big")
