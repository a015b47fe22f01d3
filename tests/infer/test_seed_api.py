"""The seed guide's library examples (../shared/seeds/caramba-inference-guide.md), run with only the
import prefix changed (`infer` -> `caramba.infer`, `cache` / `config.kvcache` -> `caramba.cache`), on
a tiny model. Where the guide names a device this machine may lack ("mps"), the test uses cpu."""

from __future__ import annotations

import pytest
import torch

from test_cli import write_tiny_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from caramba.model.zoo import load_model

    return load_model(str(write_tiny_model(tmp_path_factory.mktemp("seed") / "model")), "float32", "cpu", progress=False)


@pytest.fixture
def model(loaded):
    return loaded.model


@pytest.fixture
def tokenizer(loaded):
    return loaded.tokenizer


@pytest.fixture
def input_ids(tokenizer):
    return torch.tensor([tokenizer.encode("hello there")])


@pytest.fixture(autouse=True)
def _runs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))   # where cache_kind="auto" stores its plan


def test_overview_quick_and_configured_auto(model, input_ids, tmp_path):
    from caramba.infer import GenerateConfig, Generator, generate

    # Quick generation
    output_ids = generate(model, input_ids, max_new_tokens=64)

    # Configured generation
    config = GenerateConfig(
        max_new_tokens=128,
        temperature=0.8,
        top_k=50,
        cache_kind="auto",
    )
    generator = Generator(model, config=config)
    output_ids = generator.generate(input_ids)

    assert output_ids.shape[0] == 1 and output_ids.shape[1] > input_ids.shape[1]
    assert generator.cache_auto is not None and generator.config.cache_kind != "auto"
    assert (tmp_path / "runs").exists()   # the plan was stored


def test_basic_usage(model, input_ids):
    from caramba.infer import GenerateConfig, generate

    # Stateless generation (simplest)
    output_ids = generate(
        model,
        input_ids,           # Shape: (B, T)
        max_new_tokens=64,
        temperature=0.8,
    )

    # Configured generation
    config = GenerateConfig(
        max_new_tokens=128,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        eos_token_id=2,
    )
    output_ids = generate(model, input_ids, config=config)
    assert output_ids[0, : input_ids.shape[1]].tolist() == input_ids[0].tolist()


def test_stateful_generator(model, input_ids):
    from caramba.infer import GenerateConfig, Generator

    device = "cpu"
    input_ids_1, input_ids_2 = input_ids, input_ids[:, :3]
    config = GenerateConfig(
        max_new_tokens=128,
        max_seq_len=4096,
        cache_kind="fp16",
    )

    generator = Generator(model, config=config, device=device)

    # First generation
    generator.generate(input_ids_1)

    # Continue with context
    output2 = generator.generate(input_ids_2)

    # Reset cache for new conversation
    generator.reset()
    assert generator.cache is None and output2.shape[1] > input_ids_2.shape[1]


def test_cache_kind_enum():
    from caramba.infer import GenerateConfig
    from caramba.cache import KVCacheKind

    config = GenerateConfig(
        cache_kind=KVCacheKind.FP16,  # or "fp16"
        max_seq_len=4096,
    )
    assert config.cache_kind == "fp16"


def test_manual_cache_configuration():
    from caramba.cache import LayerKVCache, DecoupledLayerKVCache
    from caramba.cache import KVCacheTensorConfig, KVCacheKind

    # Standard cache
    cache = LayerKVCache(
        batch_size=1,
        max_seq_len=2048,
        k_dim=256,
        v_dim=256,
        k_cfg=KVCacheTensorConfig(kind=KVCacheKind.Q8_0),
        v_cfg=KVCacheTensorConfig(kind=KVCacheKind.FP16),
        device=torch.device("cpu"),
    )

    # Decoupled cache for DBA
    cache = DecoupledLayerKVCache(
        batch_size=1,
        max_seq_len=2048,
        k_sem_dim=128,   # Semantic keys
        k_geo_dim=256,   # Geometric keys
        v_dim=256,
        k_sem_cfg=KVCacheTensorConfig(kind=KVCacheKind.FP16),
        k_geo_cfg=KVCacheTensorConfig(kind=KVCacheKind.FP16),
        v_cfg=KVCacheTensorConfig(kind=KVCacheKind.FP16),
        device=torch.device("cpu"),
    )
    assert cache.length == 0


def test_auto_cache_configurations(model, input_ids, tmp_path):
    from caramba.infer import GenerateConfig, Generator

    config = GenerateConfig(
        cache_kind="auto",  # Let caramba choose
        cache_budget_mb=1024,  # Memory budget
    )
    config = GenerateConfig(
        cache_kind="auto",

        # Budget constraint
        cache_budget_mb=1024,

        # Quality gates
        cache_quality_max_delta_nll=0.05,   # Max NLL increase
        cache_quality_max_ppl_ratio=1.05,   # Max PPL ratio
        cache_quality_max_mean_kl=0.1,      # Needle-in-haystack gate
        cache_quality_prompt_len=64,
        cache_quality_decode_steps=4,

        # Benchmarking
        cache_auto_benchmark=True,
        cache_auto_bench_steps=8,
        cache_auto_bench_prompt_len=64,

        # Persistence
        cache_plan_path=str(tmp_path / "runs/cache_plans.json"),
        cache_plan_probe=True,
        cache_plan_probe_interval_sec=3600,
    )
    generator = Generator(model, config=config, tokenizer=None)
    generator.generate(input_ids)   # the zoo's model knows its tokenizer for the gates
    first = generator.cache_auto
    assert first["plan_status"] == "measured" and (tmp_path / "runs/cache_plans.json").exists()
    again = Generator(model, config=config)
    again.generate(input_ids)
    assert again.cache_auto["plan_status"] == "reused" and again.cache_auto["resolved"] == first["resolved"]

    config = GenerateConfig(
        cache_kind="auto",
        cache_plan_path="runs/cache_plans.json",  # Save decisions
        cache_plan_probe=True,  # Re-evaluate periodically
        cache_plan_probe_interval_sec=3600,  # Every hour
    )
    assert config.cache.auto.plan_path == "runs/cache_plans.json"


def test_speculative_examples(model, input_ids):
    from caramba.infer import SpeculativeGenerator, SpeculativeConfig

    large_model = small_model = model
    config = SpeculativeConfig(
        spec_k=4,              # Draft 4 tokens per step
        max_new_tokens=128,
        temperature=0.8,
    )

    generator = SpeculativeGenerator(
        target_model=large_model,
        draft_model=small_model,
        config=config,
    )

    generator.generate(input_ids)
    print(f"Acceptance rate: {generator.acceptance_rate:.2%}")
    assert generator.acceptance_rate == 1.0   # the draft is the target: every draft is accepted

    config = SpeculativeConfig(
        spec_k=4,
        spec_k_adaptive=True,          # Enable adaptive K
        spec_disable_below_accept=0.3, # Fall back if acceptance < 30%
        max_new_tokens=128,
    )
    assert config.spec_k_adaptive and config.generate.max_new_tokens == 128


def test_decode_plan_examples():
    from caramba.infer import GenerateConfig

    config = GenerateConfig(
        decode_plan="auto",  # auto, fixed, none
    )
    config = GenerateConfig(
        decode_plan="auto",

        # Bucket thresholds
        decode_bucket_short=512,
        decode_bucket_mid=2048,

        # Fixed values (for decode_plan="fixed")
        decode_q_chunk=128,
        decode_local_window=512,
    )
    config = GenerateConfig(
        max_seq_len=8192,
        cache_kind="q8",        # Quantized cache
        decode_plan="auto",     # Adaptive chunking
        cache_budget_mb=2048,   # Memory limit
    )
    assert config.cache_kind == "q8_0" and config.plan.plan == "auto"


def test_batch_and_streaming(model, tokenizer, capsys):
    from caramba.infer import GenerateConfig, Generator

    config = GenerateConfig(max_new_tokens=8, temperature=0.0)
    generator = Generator(model, config=config)

    # Multiple prompts
    prompts = [
        "The weather today is",
        "In the year 2050,",
        "The secret to happiness is",
    ]

    input_ids = tokenizer(prompts, return_tensors="pt", padding=True)
    output_ids = generator.generate(input_ids["input_ids"])

    for i, text in enumerate(tokenizer.batch_decode(output_ids)):
        print(f"Prompt {i}: {text}")

    generator = Generator(model, config=config, device="cpu")

    # Token-by-token generation
    input_ids = tokenizer.encode("Hello", return_tensors="pt")
    for token_id in generator.generate_iter(input_ids):
        print(tokenizer.decode([token_id]), end="", flush=True)
    printed = capsys.readouterr().out
    assert "Prompt 2: The secret to happiness is" in printed


def test_generate_batched_text(model, tokenizer):
    """Seed 004 (capibara): generate_batched(prompts: list[str], batch_size=3, max_new_tokens=...)
    gives completions as text when it has a tokenizer; lists of ids still give ids."""
    from caramba.infer import generate_batched

    prompts = [
        "Summarize this article:",
        "Translate to Spanish:",
        "Write a poem about:"
    ]
    outputs = generate_batched(model, prompts, batch_size=3, max_new_tokens=8, temperature=0.0, tokenizer=tokenizer)
    assert len(outputs) == 3 and all(isinstance(t, str) for t in outputs)
    ids = generate_batched(model, [tokenizer.encode(p) for p in prompts], batch_size=3, max_new_tokens=8, temperature=0.0,
                           tokenizer=tokenizer)
    assert [tokenizer.decode(s, skip_special_tokens=True) for s in ids.sequences] == outputs
