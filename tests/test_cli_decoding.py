"""`caramba generate` and `mode: generate` manifests with beam search, contrastive search and
the added processors, on the tiny HF-layout model of test_cli.py."""

from __future__ import annotations

import json

import pytest

from caramba.infer import GenerateConfig, Generator, beam_search, contrastive_search
from conftest import write_manifest
from test_cli import invoke, tiny_model  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def loaded(tiny_model):  # noqa: F811
    from caramba.model.zoo import load_model

    return load_model(str(tiny_model), "float32", "cpu", progress=False)


def test_beams_json_lists_every_sequence_with_its_score(tiny_model, loaded):  # noqa: F811
    r = invoke("generate", "hello", "--model", tiny_model, "--max-new-tokens", "6", "--num-beams", "3",
               "--num-return-sequences", "3", "--length-penalty", "0.5", "--early-stopping", "never", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    want = beam_search(loaded.model, [list(b"hello")], GenerateConfig(
        max_new_tokens=6, temperature=0, num_beams=3, num_return_sequences=3, length_penalty=0.5,
        early_stopping="never", eos_token_id=list(loaded.tokenizer.stop_token_ids)))
    assert data["strategy"] == "beam"
    assert [s["output_ids"] for s in data["beams"]] == want.sequences[0]
    assert [s["score"] for s in data["beams"]] == pytest.approx(want.scores[0])
    assert data["output_ids"] == want.sequences[0][0] and all("text" in s for s in data["beams"])


def test_beams_text_output_ranks_them(tiny_model):  # noqa: F811
    r = invoke("generate", "hello", "--model", tiny_model, "--max-new-tokens", "4", "--num-beams", "2",
               "--num-return-sequences", "2")
    assert r.exit_code == 0, r.output
    assert r.output.count("hello") == 2 and "#2 (score" in r.output


def test_contrastive_json(tiny_model, loaded):  # noqa: F811
    r = invoke("generate", "hello", "--model", tiny_model, "--max-new-tokens", "6", "--penalty-alpha", "0.6",
               "--top-k", "4", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    want = contrastive_search(loaded.model, [list(b"hello")], GenerateConfig(
        max_new_tokens=6, temperature=0, penalty_alpha=0.6, top_k=4, eos_token_id=list(loaded.tokenizer.stop_token_ids)))
    assert data["strategy"] == "contrastive" and data["output_ids"] == want.sequences[0]
    assert len(data["beams"]) == 1 and data["beams"][0]["score"] is None


def test_processors_reach_the_generator(tiny_model, loaded):  # noqa: F811
    args = ["--no-repeat-ngram-size", "2", "--frequency-penalty", "0.5", "--presence-penalty", "40", "--min-new-tokens", "3",
            "--min-p", "0.1"]
    r = invoke("generate", "abab", "--model", tiny_model, "--max-new-tokens", "40", *args, "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)["output_ids"]
    cfg = GenerateConfig(max_new_tokens=40, temperature=0, no_repeat_ngram_size=2, frequency_penalty=0.5,
                         presence_penalty=40, min_new_tokens=3, min_p=0.1)
    want = Generator(loaded.model, cfg, tokenizer=loaded.tokenizer).run([list(b"abab")]).sequences[0]
    plain = json.loads(invoke("generate", "abab", "--model", tiny_model, "--max-new-tokens", "40", "--json").output)
    assert got == want and len(set(got)) == len(got)   # the presence penalty forbids any repeat
    assert len(set(plain["output_ids"])) < len(plain["output_ids"])


@pytest.mark.parametrize("args, message", [
    (["--num-beams", "2", "--num-return-sequences", "3"], "num-return-sequences"),
    (["--penalty-alpha", "0.5"], "top_k"),
    (["--num-beams", "2", "--early-stopping", "maybe"], "--early-stopping"),
    (["--num-beams", "2", "--temperature", "0.7"], "deterministic"),
    (["--num-beams", "2", "--speculative", "prompt_lookup"], "speculative decoding"),
    (["--no-repeat-ngram-size", "2", "--speculative", "prompt_lookup"], "speculative decoding"),
])
def test_search_bad_input_exits_2(tiny_model, args, message):  # noqa: F811
    r = invoke("generate", "hello", "--model", tiny_model, "--max-new-tokens", "4", *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_manifest_beam_run_records_every_beam(tiny_model, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    manifest = tmp_path / "m.yaml"
    write_manifest(manifest, f"""\
      - id: beams
        mode: generate
        model: {{source: "{tiny_model}"}}
        generate:
          prompts: ["hello", "a longer prompt"]
          max_new_tokens: 5
          temperature: 0
          num_beams: 3
          num_return_sequences: 2
          no_repeat_ngram_size: 3
          batch_size: 2
""", name="tiny")
    r = invoke("run", manifest)
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "runs" / "tiny" / "t" / "beams" / "result.json").read_text())
    for p in result["prompts"]:
        assert p["strategy"] == "beam" and len(p["beams"]) == 2
        assert p["beams"][0]["score"] >= p["beams"][1]["score"] and p["output_ids"] == p["beams"][0]["output_ids"]


@pytest.mark.parametrize("extra, message", [
    ("num_beams: 2\n          num_return_sequences: 3", "num_return_sequences"),
    ("penalty_alpha: 0.5", "top_k"),
    ("num_beams: 2\n          top_k: 5", "top_k"),
    ("early_stopping: sometimes", "early_stopping"),
])
def test_manifest_rejects_inconsistent_search_settings(tmp_path, extra, message):
    manifest = tmp_path / "m.yaml"
    write_manifest(manifest, f"""\
      - id: r
        mode: generate
        generate:
          prompts: ["hello"]
          {extra}
""", name="tiny")
    r = invoke("validate", manifest)
    assert r.exit_code == 2, r.output
    assert message in r.output
