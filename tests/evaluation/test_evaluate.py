"""`caramba eval`'s engine and command: teacher-forced NLL/PPL, KL against a baseline cache and
top-1 agreement, on tiny models; the bundled corpus; CLI errors and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from caramba.cache import CachePolicy
from caramba.cli import app
from caramba.evaluation import evaluate as evaluate_module
from caramba.evaluation.evaluate import (BaselineLogits, adds_bos, chunk_windows, corpus_text, evaluate_cache,
                                        evaluate_chunks)
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


TIMED = ("decode_tok_s", "baseline_decode_tok_s")   # the steps' measured speeds: the only fields a rerun changes


def scores(result) -> dict:
    return {k: v for k, v in result.to_dict().items() if k not in TIMED}


@pytest.mark.parametrize("protocol", ["decode", "chunks"])
def test_a_candidate_scored_against_kept_baseline_logits_equals_its_lockstep_score(protocol, monkeypatch):
    """The baseline's logits handed out by one run and read back by the next (a new candidate of a
    finished eval): the candidate's scores are bit for bit its lockstep run's, and the baseline
    does not run again."""
    model = make_model(std=0.1)
    ids = text_ids(48, seed=2)
    q8, q4 = CachePolicy.build("q8_0", qblock=8), CachePolicy.build("q4_0", qblock=8)
    score = (lambda cands, **kw: evaluate_cache(model, ids, cands, prompt_len=16, **kw)) if protocol == "decode" \
        else (lambda cands, **kw: evaluate_chunks(model, ids, cands, ctx=16, **kw))
    handed: list[BaselineLogits] = []
    both = score([q8, q4], on_baseline=handed.append)
    (kept,) = handed
    n_scored = 32 if protocol == "decode" else 3 * 7
    assert kept.logits.shape == (n_scored, V) and kept.logits.dtype == torch.float32
    assert (kept.decode_tok_s is not None) == (protocol == "decode")
    built = []
    monkeypatch.setattr(evaluate_module._Run, "close", lambda self: built.append(self))  # each cache run, once
    (alone,) = score([q4], baseline_logits=kept, on_baseline=handed.append)
    assert scores(alone) == scores(both[1]) and len(handed) == 1        # nothing handed out again
    if protocol == "decode":
        assert len(built) == 1 and alone.baseline_decode_tok_s == kept.decode_tok_s   # only the candidate ran
    # the kept rows are what it is scored against: other logits, other scores
    (other,) = score([q4], baseline_logits=BaselineLogits(kept.logits.flip(0)))
    assert other.kl_mean != alone.kl_mean and other.baseline_nll != alone.baseline_nll
    with pytest.raises(ValueError, match="kept logits are"):
        score([q4], baseline_logits=BaselineLogits(kept.logits[1:]))


def test_joined_lockstep_scores_are_each_candidates_own_bit_for_bit(monkeypatch):
    """The plain caches of one model step as one joined C call (the weights read once) with exact
    rows, CHUNK tokens at a time (stepwise) or, with per-channel keys among them (one token a call),
    token by token: every candidate's scores are bit for bit those of scoring it alone against the
    kept baseline, whatever ran beside it: kinds the C step takes in chunks, per-channel keys,
    per-channel values (which it refuses: the torch path, alone) and a pressed cache (never
    joined). Each cache is timed alone on every SPEED_EVERY-th step: its decode_tok_s."""
    from caramba.model import fast_decode
    from caramba.press import PressConfig

    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    joins, real = [], fast_decode.step_joined
    monkeypatch.setattr(fast_decode, "step_joined", lambda model, calls, **kw: joins.append(
        (len(calls), calls[0][0].shape[1] if kw.get("stepwise") else 0)) or real(model, calls, **kw))
    model = make_model(std=0.1)
    ids = text_ids(80, seed=3)
    cands = [CachePolicy.build("q8_0", qblock=8), CachePolicy.build("fp16"),
             CachePolicy.build("q4_1", policy="k=q4_1c", qblock=4), CachePolicy.build("q4_1", policy="v=q4_1c", qblock=4),
             CachePolicy.build("nf4", qblock=8)]
    presses = [None, None, None, None, PressConfig(method="knorm", ratio=0.5)]
    handed: list[BaselineLogits] = []
    together = evaluate_cache(model, ids, cands, prompt_len=16, presses=presses, on_baseline=handed.append)
    steps = 80 - 16 - 1
    timed = len(range(evaluate_module.SPEED_EVERY // 2, steps, evaluate_module.SPEED_EVERY))   # 16 and 48
    # k=q4_1c takes one token a call: the baseline, q8_0, fp16 and k=q4_1c token by token, joined
    assert joins == [(4, 0)] * (steps - timed)
    assert all(r.decode_tok_s and r.baseline_decode_tok_s for r in together)
    del joins[:]
    for cand, press, want in zip(cands, presses, together):
        (alone,) = evaluate_cache(model, ids, [cand], prompt_len=16, presses=[press], baseline_logits=handed[0])
        assert scores(alone) == scores(want), cand.describe()
    # q8_0 and fp16 alone: stepwise between the timed steps (16, 16 + 15, 14 tokens: CHUNK at most)
    assert joins == [(1, 16), (1, 16), (1, 15), (1, 14)] * 2
    # a lockstep of caches the C step takes in chunks: stepwise, joined, the same scores
    del joins[:]
    chunked = evaluate_cache(model, ids, cands[:2], prompt_len=16, baseline_logits=handed[0])
    assert joins == [(2, 16), (2, 16), (2, 15), (2, 14)]
    assert [scores(r) for r in chunked] == [scores(r) for r in together[:2]]


def test_a_rows_kl_sum_does_not_depend_on_torchs_thread_count():
    """The KL's sum over a long vocabulary (evaluate.row_sums): the same bits at 1 and 2 threads
    (torch's own sum of a [1, 262144] row splits it between the threads), within fp32 rounding of
    the float64 sum; rows of any length, padded blocks included."""
    g = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    for shape in ((1, 262147), (3, 49152), (2, 1003)):
        t = torch.rand(*shape, generator=g) * 1e-3
        got = {}
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                got[n] = evaluate_module.row_sums(t)
        finally:
            torch.set_num_threads(before)
        assert got[1].shape == shape[:1] and torch.equal(got[1], got[2]), shape
        exact = t.double().sum(-1)
        assert ((got[1].double() - exact).abs() <= shape[1] * 2**-24 * exact).all(), shape


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


def test_cli_eval_candidate_flags_come_from_cache_config(tiny_dir):
    """--qblock, --residual-len, ... are CacheConfig's options (one definition): their help, bounds
    and checks, with the flag named in the error."""
    from caramba.infer.config import CacheConfig
    from caramba.options import options_of

    odd = invoke("eval", "--model", tiny_dir, "--qblock", "3")
    assert odd.exit_code == 2 and "--qblock 3: must be a multiple of 2" in odd.output
    assert invoke("eval", "--model", tiny_dir, "--residual-len", "-1").exit_code == 2
    import typer

    params = {p.name: p for p in typer.main.get_command(app).commands["eval"].params}
    for opt in options_of(CacheConfig):
        if opt.name in ("qblock", "residual_len", "rotate_keys", "rotate_values", "cache_fp16_prefix_layers"):
            assert opt.info.help[1:] in params[opt.name].help and params[opt.name].default == opt.default(), opt.name


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


# ---- --protocol chunks (llama-perplexity's windows) ------------------------------------------------

def reference_chunks(model, ids, ctx, bos=None):
    """Per-token NLLs of llama.cpp's protocol, from full forwards without a cache."""
    nll = []
    for s in range(0, len(ids) - ctx + 1, ctx):
        w = list(ids[s : s + ctx])
        if bos is not None:
            w[0] = bos
        logp = torch.log_softmax(model(torch.tensor([w]))[0].double(), dim=-1)
        nll += [-float(logp[j, w[j + 1]]) for j in range(ctx // 2, ctx - 1)]
    return torch.tensor(nll, dtype=torch.float64)


def test_chunks_fp32_is_llamacpp_protocol_with_its_standard_error():
    model = make_model(std=0.1)
    ids = text_ids(70, seed=3)                       # 4 windows of 16; the 6-token tail is dropped
    (r,) = evaluate_chunks(model, ids, ["fp32"], "fp32", ctx=16)
    ref = reference_chunks(model, ids, 16)
    assert r.protocol == "chunks" and r.n_scored == 4 * 7 == ref.numel()
    assert r.nll == pytest.approx(float(ref.mean()), abs=1e-5) and r.nll == r.baseline_nll
    assert r.kl_mean == 0 and r.top1_agreement == 1
    # llama.cpp: PPL * sqrt((E[nll^2] - E[nll]^2) / (N - 1)), i.e. PPL * the std error of the mean NLL
    se = math.exp(float(ref.mean())) * float(ref.std(unbiased=False)) / math.sqrt(ref.numel() - 1)
    assert r.ppl_stderr == pytest.approx(se, rel=1e-4) and r.baseline_ppl_stderr == r.ppl_stderr
    d = r.to_dict()
    assert d["protocol"] == "chunks" and d["ppl_stderr"] == r.ppl_stderr


def test_chunks_put_bos_first_in_every_window():
    model = make_model(std=0.1)
    ids = text_ids(48, seed=4)
    (r,) = evaluate_chunks(model, ids, ["fp32"], ctx=16, bos=1)
    assert r.nll == pytest.approx(float(reference_chunks(model, ids, 16, bos=1).mean()), abs=1e-5)
    assert chunk_windows([5, 6, 7, 8, 9], 2, bos=0) == [[0, 6], [0, 8]]


def test_chunks_read_the_quantized_cache_like_token_by_token_decode():
    """Every token of a window goes through the cache: the prefill attends over the stored q4_0
    codes (its own key included), which is what one-token forwards read."""
    model = make_model(std=0.1)
    ids = text_ids(32, seed=5)
    policy = CachePolicy.build("q4_0", qblock=8)
    fp, q4 = evaluate_chunks(model, ids, ["fp32", policy], ctx=16)
    assert q4.nll != fp.nll and q4.kl_mean > 0
    nll = []
    for s in (0, 16):
        cache = model.new_cache(1, 16, policy)
        logits = torch.cat([model(torch.tensor([[t]]), cache=cache)[0] for t in ids[s : s + 16]])
        logp = torch.log_softmax(logits.double(), dim=-1)
        nll += [-float(logp[j, ids[s + j + 1]]) for j in range(8, 15)]
    assert q4.nll == pytest.approx(sum(nll) / len(nll), abs=1e-4)


def test_chunks_errors_and_adds_bos():
    with pytest.raises(ValueError, match="ctx=15 must be an even"):
        evaluate_chunks(make_model(), text_ids(40), ["q8_0"], ctx=15)
    with pytest.raises(ValueError, match="needs at least 64"):
        evaluate_chunks(make_model(), text_ids(40), ["q8_0"], ctx=64)

    class Tok:
        bos_token_id = 7

        def __init__(self, add):
            self.add = add

        def encode(self, text, add_special_tokens=True):
            return ([7] if add_special_tokens and self.add else []) + [3]

    assert adds_bos(Tok(True)) and not adds_bos(Tok(False))


def test_cli_eval_chunks_json(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(corpus_text()[:600])
    r = invoke("eval", "--text", text, "--model", tiny_dir, "--cache-kind", "q4_0", "--qblock", "8",
               "--protocol", "chunks", "--ctx", "32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["protocol"] == "chunks" and out["ctx"] == 32 and out["n_chunks"] == out["n_tokens"] // 32
    (x,) = out["results"]
    assert x["protocol"] == "chunks" and x["n_scored"] == out["n_chunks"] * 15 and x["ppl_stderr"] > 0
    table = invoke("eval", "--text", text, "--model", tiny_dir, "--qblock", "8", "--protocol", "chunks", "--ctx", "32")
    assert table.exit_code == 0 and "+/-" in table.stdout and "windows of 32 tokens" in table.stdout
    bad = invoke("eval", "--text", text, "--model", tiny_dir, "--protocol", "sliding")
    assert bad.exit_code == 2 and "--protocol" in bad.output
    odd = invoke("eval", "--text", text, "--model", tiny_dir, "--protocol", "chunks", "--ctx", "33")
    assert odd.exit_code == 2 and "--ctx 33" in odd.output
