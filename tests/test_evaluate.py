"""`caramba eval`'s engine and command: teacher-forced NLL/PPL, KL against a baseline cache and
top-1 agreement, on tiny models; the bundled corpus; CLI errors and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from caramba.cache import CachePolicy
from caramba.cli import app
from caramba.infer.evaluate import corpus_text, evaluate_cache
from conftest import TINY, make_model
from test_cli import write_tiny_model
from typer.testing import CliRunner

V = TINY["vocab_size"]


def text_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_fp32_candidate_equals_the_baseline_and_the_no_cache_nll():
    model = make_model(std=0.1)
    ids = text_ids(30)
    (r,) = evaluate_cache(model, ids, ["fp32"], "fp32", prompt_len=10)
    assert r.n_scored == 20 and r.kl_mean == 0 and r.kl_max == 0 and r.top1_agreement == 1
    assert r.nll == r.baseline_nll
    # teacher-forced through the cache == one full forward without a cache
    logp = torch.log_softmax(model(torch.tensor([ids]))[0], dim=-1)
    expected = -float(sum(logp[t - 1, ids[t]] for t in range(10, 30))) / 20
    assert r.nll == pytest.approx(expected, abs=1e-4)
    assert r.ppl == pytest.approx(float(torch.tensor(expected).exp()), rel=1e-4)


def test_quantized_candidates_are_ranked_by_their_error():
    model = make_model(std=0.1)
    ids = text_ids(40, seed=1)
    q8, q4 = evaluate_cache(model, ids, [CachePolicy.build("q8_0", qblock=8), CachePolicy.build("q4_0", qblock=8)],
                            prompt_len=8)
    assert 0 < q8.kl_mean < q4.kl_mean and q8.kl_max <= q4.kl_max
    assert q8.kl_mean <= q8.kl_max and 0 <= q4.top1_agreement <= q8.top1_agreement <= 1
    assert q8.baseline_nll == q4.baseline_nll and q8.policy == "q8_0 qblock=8"
    assert q4.bytes_per_token < q8.bytes_per_token
    d = q8.to_dict()
    assert d["dnll"] == q8.nll - q8.baseline_nll and d["ppl_ratio"] == q8.ppl / q8.baseline_ppl


def test_too_short_text_is_an_error():
    with pytest.raises(ValueError, match="prompt_len=10 needs at least 12"):
        evaluate_cache(make_model(), text_ids(11), ["q8_0"], prompt_len=10)


def test_bundled_corpus_is_prose_and_code():
    text = corpus_text()
    assert len(text) > 15000 and "```python" in text and "lighthouse" in text   # ~4.1k SmolLM2 tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-eval") / "model")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_eval_json(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(corpus_text()[:600])
    r = invoke("eval", "--text", text, "--model", tiny_dir, "--cache-kind", "q8", "--cache-policy", "k=q8_0,v=q4_0",
               "--qblock", "8", "--prompt-len", "16", "--max-tokens", "60", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["n_tokens"] == 60 and out["baseline"] == "fp32"
    names = [x["policy"] for x in out["results"]]
    assert names == ["q8_0 qblock=8", "k=q8_0,v=q4_0 qblock=8"]
    for x in out["results"]:
        assert x["n_scored"] == 44 and x["kl_mean"] > 0 and 0 < x["top1_agreement"] <= 1


def test_cli_eval_table_and_errors(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(corpus_text()[:300])
    r = invoke("eval", "--text", text, "--model", tiny_dir, "--qblock", "8", "--prompt-len", "8", "--max-tokens", "30")
    assert r.exit_code == 0, r.output
    assert "q8_0" in r.stdout and "mean KL" in r.stdout
    bad = invoke("eval", "--text", text, "--model", tiny_dir, "--cache-kind", "q3")
    assert bad.exit_code == 2 and "valid kinds" in bad.output
    short = invoke("eval", "--text", text, "--model", tiny_dir, "--prompt-len", "500")
    assert short.exit_code == 2 and "--prompt-len 500" in short.output
    missing = invoke("eval", "--text", tmp_path / "nope.txt", "--model", tiny_dir)
    assert missing.exit_code == 2 and "no such file" in missing.output


def test_cli_generate_with_a_quantized_cache_policy(tiny_dir):
    r = invoke("generate", "hello", "--model", tiny_dir, "--max-new-tokens", "5", "--cache-policy", "k=q8_0,v=nf4",
               "--qblock", "8", "--rotate-keys", "--residual-len", "2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out["output_ids"]) == 5
    assert out["cache_policy"] == {"k": "q8_0", "v": "nf4", "qblock": 8, "residual_len": 2, "rotate_keys": True,
                                   "cache_fp16_prefix_layers": 0}
    bad = invoke("generate", "hello", "--model", tiny_dir, "--cache-policy", "q=q8_0")
    assert bad.exit_code == 2 and "unknown stream" in bad.output
