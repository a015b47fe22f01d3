"""Quantized KV caches on the real SmolLM2-135M: the q8_0 quality gate (KL against the fp32
cache, teacher-forced through the cache on caramba's corpus) and greedy agreement."""

from __future__ import annotations



from conftest import SMOLLM2

pytestmark = SMOLLM2


def test_q8_0_cache_passes_the_kl_gate(smollm2):
    from caramba.evaluation.evaluate import corpus_ids, evaluate_cache

    ids = corpus_ids(smollm2.tokenizer)[:448]
    (q8,) = evaluate_cache(smollm2.model, ids, ["q8_0"], "fp32", prompt_len=320)
    assert q8.n_scored == 128
    assert q8.kl_mean <= 1e-3, q8
    assert abs(q8.dnll) <= 0.005, q8
    assert q8.top1_agreement >= 0.97, q8


def test_greedy_with_a_q8_0_cache_matches_fp32(smollm2):
    from caramba.infer import GenerateConfig, Generator
    from caramba.prompting import encode_prompt

    ids = encode_prompt(smollm2.tokenizer, "The three most important ideas in computer science are", False, None)
    out = {kind: Generator(smollm2.model, GenerateConfig(max_new_tokens=24, temperature=0, cache_kind=kind,
                                                        max_seq_len=128)).run([ids]).sequences[0]
           for kind in ("fp32", "q8_0")}
    agree = next((i for i, (a, b) in enumerate(zip(out["fp32"], out["q8_0"])) if a != b), 24)
    assert agree >= 16, (out, agree)


def test_greedy_with_an_fp16_cache_matches_fp32(smollm2):
    from caramba.infer import GenerateConfig, Generator
    from caramba.prompting import encode_prompt

    for prompt in ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]:
        ids = encode_prompt(smollm2.tokenizer, prompt, False, None)
        out = [Generator(smollm2.model, GenerateConfig(max_new_tokens=32, temperature=0, cache_kind=kind,
                                                      max_seq_len=128)).run([ids]).sequences[0]
               for kind in ("fp32", "fp16")]
        assert out[0] == out[1], prompt
