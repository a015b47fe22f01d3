"""The CLI end to end on a tiny random model saved as an HF directory: exit codes, errors
without tracebacks, run records, skip/force, interrupted runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers
from typer.testing import CliRunner

import caramba.runners as runners
from caramba.cli import app
from caramba.tokenizer import Tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab() -> dict[str, int]:
    """GPT-2's byte -> printable character map, so token id == byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {ch: b for b, ch in chars.items()}


def write_tiny_model(directory: Path) -> Path:
    """A 2-layer Llama with a byte-level tokenizer (256 bytes + 3 specials), HF layout."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {**byte_level_vocab(), **{s: 256 + i for i, s in enumerate(SPECIALS)}}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    Tokenizer(backend, eos_token_id=258, chat_template=CHAT_TEMPLATE).save(directory)

    cfg = {"model_type": "llama", "vocab_size": 259, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "tie_word_embeddings": True}
    (directory / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    tensors = {"model.embed_tokens.weight": w(259, 32), "model.norm.weight": torch.ones(32)}
    for i in range(2):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(32, 32), p + "self_attn.k_proj.weight": w(16, 32),
            p + "self_attn.v_proj.weight": w(16, 32), p + "self_attn.o_proj.weight": w(32, 32),
            p + "mlp.gate_proj.weight": w(64, 32), p + "mlp.up_proj.weight": w(64, 32),
            p + "mlp.down_proj.weight": w(32, 64), p + "input_layernorm.weight": torch.ones(32),
            p + "post_attention_layernorm.weight": torch.ones(32),
        })
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def env(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = tmp_path / "m.yaml"
    manifest.write_text(f"""\
version: 1
name: tiny
vars: {{model: "{tiny_model}"}}
defaults:
  model: {{source: "${{model}}"}}
targets:
  - type: experiment
    name: t
    runs:
      - id: greedy
        mode: generate
        seed: 0
        generate:
          prompts: ["hello", "a longer prompt here"]
          max_new_tokens: 8
          temperature: 0.0
          batch_size: 2
      - id: sampled
        mode: generate
        seed: 1
        generate:
          prompts: ["hi"]
          chat: true
          max_new_tokens: 6
          temperature: 0.8
          top_k: 20
""")
    return manifest, tmp_path / "runs" / "tiny" / "t"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_run_writes_complete_records_then_skips_then_forces(env):
    manifest, records = env
    first = invoke("run", manifest)
    assert first.exit_code == 0, first.output
    for run_id in ("greedy", "sampled"):
        files = {p.name for p in (records / run_id).iterdir()}
        assert files == {"manifest.yaml", "env.json", "result.json", "log.txt", "DONE"}
    result = json.loads((records / "greedy" / "result.json").read_text())
    assert [len(p["output_ids"]) for p in result["prompts"]] == [8, 8]
    assert result["prompts"][0]["prompt_ids"] == list("hello".encode())
    env_json = json.loads((records / "greedy" / "env.json").read_text())
    assert env_json["seed"] == 0 and "torch_version" in env_json

    done_stamp = (records / "greedy" / "DONE").read_text()
    second = invoke("run", manifest)
    assert second.exit_code == 0 and "skip" in second.output
    assert (records / "greedy" / "DONE").read_text() == done_stamp

    third = invoke("run", manifest, "--run", "greedy", "--force")
    assert third.exit_code == 0
    rerun = json.loads((records / "greedy" / "result.json").read_text())
    assert [p["output_ids"] for p in rerun["prompts"]] == [p["output_ids"] for p in result["prompts"]]


def test_seeded_sampling_run_is_reproducible(env):
    manifest, records = env
    assert invoke("run", manifest, "--run", "sampled").exit_code == 0
    first = json.loads((records / "sampled" / "result.json").read_text())["prompts"][0]["output_ids"]
    assert invoke("run", manifest, "--run", "sampled", "--force").exit_code == 0
    again = json.loads((records / "sampled" / "result.json").read_text())["prompts"][0]["output_ids"]
    assert first == again


def test_set_override_reaches_the_record(env):
    manifest, records = env
    r = invoke("run", manifest, "--run", "greedy", "--set", "targets.t.runs.greedy.generate.max_new_tokens=3")
    assert r.exit_code == 0, r.output
    result = json.loads((records / "greedy" / "result.json").read_text())
    assert all(len(p["output_ids"]) == 3 for p in result["prompts"])
    assert "max_new_tokens: 3" in (records / "greedy" / "manifest.yaml").read_text()


def test_bad_manifest_exits_2_with_file_line_and_writes_nothing(env, tmp_path):
    manifest, records = env
    manifest.write_text(manifest.read_text().replace("temperature: 0.0", "temprature: 0.0"))
    r = invoke("run", manifest)
    assert r.exit_code == 2
    assert f"{manifest}:" in r.output and "temprature" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "runs").exists()


def test_missing_model_exits_2_and_writes_nothing(env, tmp_path):
    manifest, _ = env
    r = invoke("run", manifest, "--set", "vars.model=/nonexistent/model.gguf")
    assert r.exit_code == 2 and "/nonexistent/model.gguf" in r.output
    assert not (tmp_path / "runs").exists()


def test_unknown_run_id_exits_2(env):
    r = invoke("run", env[0], "--run", "nope")
    assert r.exit_code == 2 and "t/greedy" in r.output


def test_dry_run_writes_nothing(env, tmp_path):
    r = invoke("run", env[0], "--dry-run")
    assert r.exit_code == 0 and "would run t/greedy" in r.output
    assert not (tmp_path / "runs").exists()


def test_failed_run_exits_1_without_done_and_others_still_run(env, monkeypatch):
    manifest, records = env

    def boom(loaded, settings, seed, record, console):
        if settings.chat:
            raise RuntimeError("simulated failure")
        return real(loaded, settings, seed, record, console)

    real = runners.MODE_RUNNERS["generate"]
    monkeypatch.setitem(runners.MODE_RUNNERS, "generate", boom)
    r = invoke("run", manifest)
    assert r.exit_code == 1 and "simulated failure" in r.output
    assert (records / "greedy" / "DONE").exists()
    assert not (records / "sampled" / "DONE").exists()
    assert "simulated failure" in (records / "sampled" / "log.txt").read_text()


def test_interrupted_run_keeps_completed_runs_and_leaves_no_done(env, monkeypatch):
    manifest, records = env
    real = runners.MODE_RUNNERS["generate"]

    def interrupt(loaded, settings, seed, record, console):
        if settings.chat:
            raise KeyboardInterrupt
        return real(loaded, settings, seed, record, console)

    monkeypatch.setitem(runners.MODE_RUNNERS, "generate", interrupt)
    r = invoke("run", manifest)
    assert r.exit_code == 130
    assert (records / "greedy" / "DONE").exists() and not (records / "sampled" / "DONE").exists()
    monkeypatch.setitem(runners.MODE_RUNNERS, "generate", real)
    resumed = invoke("run", manifest)
    assert resumed.exit_code == 0 and "skip t/greedy" in resumed.output
    assert (records / "sampled" / "DONE").exists()


def test_validate(env):
    r = invoke("validate", env[0])
    assert r.exit_code == 0 and "t/greedy" in r.output and "t/sampled" in r.output


@pytest.mark.parametrize("args, shown", [(["--help"], "Usage"), (["run", "--help"], "Usage"), (["plans", "--help"], "Usage"),
                                         (["plans", "list", "--plan-path", "{tmp}/plans.json"], "0 plan(s)")])
def test_help_imports_no_torch(args, shown, tmp_path):
    """`caramba --help` answers in a fraction of a second: the CLI imports torch, numpy and the
    engine (~2 s) only in the commands that run them, and builds generate's and eval's flags
    (derived from the engine's options) only when one of those runs or shows its own --help; the
    plan store's commands need none of it either."""
    args = [a.format(tmp=tmp_path) for a in args]
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "caramba", *args], capture_output=True,
                          text=True, timeout=120)
    imported = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert done.returncode == 0 and shown in done.stdout, done.stdout + done.stderr
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy")}
    assert not {m for m in imported if m.startswith(("caramba.infer", "caramba.cache", "caramba.model", "caramba.manifest"))}


def test_generate_json(tiny_model):
    r = invoke("generate", "hello", "--model", tiny_model, "--max-new-tokens", "5", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["prompt_ids"] == list(b"hello") and len(data["output_ids"]) == 5
    for key in ("text", "prefill_s", "decode_s", "decode_tok_s"):
        assert key in data
    # which kernels ran: the steps' path, and every C library's status ('c' or why not)
    assert data["kernels"]["decode_step"] in ("c",) or data["kernels"]["decode_step"].startswith(("off", "unavailable"))
    assert {"quant_weights", "kv_attention"} <= data["kernels"].keys()


def test_generate_streams_text(tiny_model):
    r = invoke("generate", "hello", "--model", tiny_model, "--max-new-tokens", "5", "--chat")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("hello")


@pytest.mark.parametrize("args, message", [
    (["--cache-kind", "q9"], "valid kinds"),
    (["--model", "/no/such.gguf"], "/no/such.gguf"),
    (["--system", "be brief"], "--chat"),
    (["--max-seq-len", "4"], "max_seq_len"),
])
def test_generate_bad_input_exits_2(tiny_model, args, message):
    base = ["generate", "a prompt that is long", "--max-new-tokens", "5"]
    if "--model" not in args:
        base += ["--model", str(tiny_model)]
    r = invoke(*base, *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
