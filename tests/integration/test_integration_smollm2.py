"""caramba against HF transformers on the real SmolLM2-135M-Instruct GGUF (the reference).

Both sides load the same file independently: caramba through its own GGUF reader and
conversion cache, HF through `from_pretrained(..., gguf_file=...)`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import tolerance as tol
from conftest import SMOLLM2

pytestmark = SMOLLM2

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is photosynthesis?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def reference():
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    from caramba.model.zoo import resolve_source

    path = resolve_source("smollm2-135m")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


def test_config_read_from_gguf(smollm2):
    cfg = smollm2.model.config
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_embeddings) == (49152, 100000.0, True)


def test_the_loaded_mlp_is_held_row_major_and_the_head_input_major(smollm2):
    """load_model's layout for a CPU model (InputMajorLinear.hold_row_major): every gate|up [out, in]
    in memory, read by the C step as rows; the tied head stays [in, out] (the embedding's rows)."""
    from caramba.model import fast_decode, quant

    model = smollm2.model
    assert {layer.mlp.w13.layout for layer in model.layers} == {"rows"} and model.head.layout is None
    assert model.head.weight_t.is_contiguous()
    if fast_decode.library() is not None:
        assert {p.w13.fmt for p in fast_decode._Plan(model).layers} == {quant.F32_ROWS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_token_ids_equal_hf(smollm2, reference, prompt):
    assert smollm2.tokenizer.encode(prompt) == reference[1].encode(prompt)


def test_fp32_logits_match_hf(smollm2, reference):
    hf, tok = reference
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            want = hf(ids).logits
            diff = (smollm2.model(ids) - want).abs().max().item()
        bound = tol.forward(want, smollm2.model.config)["atol"]   # fp32 rounding through 30 layers
        assert diff < bound, f"{prompt!r}: max |logit diff| {diff} (bound {bound:.2e})"


def test_greedy_64_tokens_identical_to_hf(smollm2, reference):
    from caramba.infer import GenerateConfig, Generator

    hf, tok = reference
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        x = torch.tensor([ids])
        with torch.inference_mode():
            expected = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        config = GenerateConfig(max_new_tokens=64, temperature=0.0, eos_token_id=tok.eos_token_id)
        got = Generator(smollm2.model, config).run([ids]).sequences[0]
        assert got == expected, f"{prompt!r}\nours: {tok.decode(got)!r}\nHF:   {tok.decode(expected)!r}"


def test_ragged_batch_equals_each_prompt_alone(smollm2):
    from caramba.infer import GenerateConfig, Generator

    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    config = GenerateConfig(max_new_tokens=24, temperature=0.0)
    batched = Generator(smollm2.model, config, tokenizer=smollm2.tokenizer).run(ids).sequences
    for row, prompt_ids in enumerate(ids):
        alone = Generator(smollm2.model, config, tokenizer=smollm2.tokenizer).run([prompt_ids]).sequences[0]
        assert batched[row] == alone


def test_multi_turn_chat_prefills_only_new_tokens(smollm2):
    from caramba.infer import GenerateConfig, Generator

    tok = smollm2.tokenizer
    config = GenerateConfig(max_new_tokens=24, temperature=0.0)
    turn1 = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}]), add_special_tokens=False)
    session = Generator(smollm2.model, config, tokenizer=tok)
    out1 = session.run([turn1]).sequences[0]
    cached = session.cache.length
    turn2 = tok.encode("\n<|im_start|>user\nAnd a vegetable?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out2 = session.run([turn2]).sequences[0]
    # Only the previous reply's last token and the new turn went through the model.
    assert session.cache.length == cached + 1 + len(turn2) + len(out2) - 1
    fresh = Generator(smollm2.model, config, tokenizer=tok).run([turn1 + out1 + turn2]).sequences[0]
    assert out2 == fresh


def test_quickstart_manifest_end_to_end(tmp_path, monkeypatch, smollm2):
    from typer.testing import CliRunner

    from caramba.cli import app

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = os.path.join(os.path.dirname(__file__), "..", "..", "manifests", "quickstart.yaml")
    result = CliRunner().invoke(app, ["run", manifest, "--run", "greedy"])
    assert result.exit_code == 0, result.output
    record = tmp_path / "runs" / "quickstart" / "hello" / "greedy"
    assert {p.name for p in record.iterdir()} == {"manifest.yaml", "env.json", "result.json", "log.txt", "DONE"}
    prompt = json.loads((record / "result.json").read_text())["prompts"][0]
    assert prompt["output_ids"] and "Paris" in prompt["text"]
    assert prompt["decode_tok_s"] > 0


def test_ci_check_manifest_still_holds(tmp_path, monkeypatch, smollm2):
    """manifests/ci-check.yaml pins the greedy output ids of three prompts (batched) by hash."""
    from typer.testing import CliRunner

    from caramba.cli import app

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = os.path.join(os.path.dirname(__file__), "..", "..", "manifests", "ci-check.yaml")
    result = CliRunner().invoke(app, ["run", manifest, "--check"])
    assert result.exit_code == 0, result.output
    assert "check ok" in result.output
