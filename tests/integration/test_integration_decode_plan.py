"""Decode plans on the real SmolLM2-135M: auto's chunked prefill of a long prompt gives the same
greedy continuation as the unchunked path, and a window + ring run stays within its ring."""

from __future__ import annotations

import warnings

import pytest

from conftest import SMOLLM2

pytestmark = SMOLLM2


@pytest.fixture(scope="module")
def prompt(smollm2):
    from caramba.evaluation.evaluate import corpus_ids

    return corpus_ids(smollm2.tokenizer)[:1200]   # in auto's mid bucket: chunks of AUTO_CHUNK_MID (1024)


@pytest.mark.parametrize("kind", ["fp32", "q8_0"])
def test_auto_chunked_prefill_matches_unchunked(smollm2, prompt, kind):
    from caramba.infer import GenerateConfig, Generator

    outs = {}
    for plan in ("none", "auto"):
        gen = Generator(smollm2.model, GenerateConfig(max_new_tokens=24, temperature=0.0, eos_token_id=None,
                                                     max_seq_len=1300, cache_kind=kind, decode_plan=plan))
        outs[plan] = gen.run([prompt]).sequences[0]
        assert gen.plan.exact and (gen.plan.q_chunk is not None) == (plan == "auto")
    assert outs["auto"] == outs["none"]


def test_window_ring_generation_runs_past_max_seq_len(smollm2, prompt):
    from caramba.cache.ring import RingKVCache
    from caramba.infer import GenerateConfig, Generator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = Generator(smollm2.model, GenerateConfig(max_new_tokens=40, temperature=0.0, eos_token_id=None, max_seq_len=256,
                                                     decode_plan="fixed", decode_local_window=256, decode_q_chunk=128))
    out = gen.run([prompt])
    assert len(out.sequences[0]) == 40 and isinstance(gen.cache, RingKVCache)
    assert gen.cache.length == 1200 + 39 and gen.cache.nbytes == smollm2.model.new_cache(1, 384, "fp32").nbytes
