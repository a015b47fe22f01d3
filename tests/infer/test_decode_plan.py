"""Decode plans: chunked forwards equal unchunked ones, sliding windows match a reference mask,
ring-buffer caches stay flat, plans resolve as documented, and manifests/CLI/bench carry them."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from caramba.bench.grid import Grid, run_grid
from caramba.cache.ring import RingKVCache
from caramba.cli import app
from caramba.infer import GenerateConfig, Generator, beam_search
from caramba.infer.plan import AUTO_CHUNK_LONG, AUTO_CHUNK_MID, DecodePlan, LocalWindowWarning, forward_chunked, parse_plan
from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator
from caramba.manifest.schema import BenchSettings, GenerateSettings
from caramba.model.transformer import Transformer
import tolerance as tol
from conftest import TINY, write_manifest
from test_cli import write_tiny_model

KINDS = ["fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4"]
V = TINY["vocab_size"]


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, prompt, n, **cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LocalWindowWarning)
        gen = Generator(model, GenerateConfig(max_new_tokens=n, temperature=0.0, **cfg))
        return gen.run(prompt).sequences, gen


# ---- chunked == unchunked -------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("q_chunk", [5, 17])   # <= 16 queries: the chunked code read; more: dequantize + SDPA
@torch.inference_mode()
def test_chunked_forward_logits_equal_unchunked(model, kind, q_chunk):
    tokens = _ids(40)
    whole = model(tokens, cache=model.new_cache(1, 64, kind))
    widths = []
    hook = model.register_forward_pre_hook(lambda _m, args: widths.append(args[0].shape[1]))
    try:
        chunked = forward_chunked(model, tokens, cache=model.new_cache(1, 64, kind), q_chunk=q_chunk)
    finally:
        hook.remove()
    assert widths == [min(q_chunk, 40 - a) for a in range(0, 40, q_chunk)]
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, **tol.cache_paths(whole, model.config, kind))
    # last_only: only the final chunk's last position comes back
    last = forward_chunked(model, tokens, cache=model.new_cache(1, 64, kind), last_only=True, q_chunk=q_chunk)
    torch.testing.assert_close(last, whole[:, -1:], **tol.cache_paths(whole, model.config, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_generation_equals_unchunked_ragged_batch_multi_turn(model, prompts, kind):
    """Left-padded ragged rows (slot_mask) and a second turn, token for token."""
    outs = []
    for plan in ({}, {"decode_plan": "fixed", "decode_q_chunk": 3}):
        seqs, gen = _greedy(model, prompts, 6, cache_kind=kind, max_seq_len=64, **plan)
        seqs2 = gen.run([[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11, 12]]).sequences
        outs.append((seqs, seqs2, gen.plan))
    assert outs[0][:2] == outs[1][:2]
    assert outs[1][2].q_chunk == 3 and outs[1][2].exact and outs[0][2].q_chunk is None


def test_chunked_speculative_verification_equals_plain_greedy(model, prompts):
    cfg = dict(max_new_tokens=12, temperature=0.0, max_seq_len=64)
    plain = Generator(model, GenerateConfig(**cfg)).run(prompts).sequences
    spec = SpeculativeGenerator(model, model, SpeculativeConfig(**cfg, spec_k=5, draft="model", decode_plan="fixed",
                                                                 decode_q_chunk=2))
    assert spec.run(prompts).sequences == plain
    assert spec.plan.q_chunk == 2 and spec.rows.q_chunk == 2   # verification feeds 6 tokens in 3 chunks


def test_chunked_beam_prefill_equals_unchunked(model, prompts):
    a = beam_search(model, prompts, GenerateConfig(max_new_tokens=5, num_beams=3, max_seq_len=64))
    b = beam_search(model, prompts, GenerateConfig(max_new_tokens=5, num_beams=3, max_seq_len=64,
                                                   decode_plan="fixed", decode_q_chunk=2))
    assert a.sequences == b.sequences
    scores = torch.tensor(a.scores)   # sums of 5 log-probs, each from a forward
    torch.testing.assert_close(torch.tensor(b.scores), scores, **tol.rounding(torch.float32, scores, 5 * tol.forward_n(model.config)))


def test_chunking_with_a_residual_window_is_recorded_inexact(model):
    _, gen = _greedy(model, _ids(30), 2, cache_kind="q4_0", residual_len=4, decode_plan="fixed", decode_q_chunk=8)
    assert gen.plan.q_chunk == 8 and not gen.plan.exact and gen.plan.window is None


# ---- sliding window against a reference mask --------------------------------------------------

def _reference_logits(model, tokens, window, monkeypatch):
    """A no-cache forward whose attention mask is a dense causal + window mask built here."""
    T = tokens.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    dense = ((j <= i) & (i - j < window))[None, None]                       # [1, 1, T, T]
    with monkeypatch.context() as m:
        m.setattr(Transformer, "_attention_mask", staticmethod(lambda *a, **k: (dense, False)))
        return model(tokens)


@torch.inference_mode()
@pytest.mark.parametrize("ring", [False, True])
def test_window_matches_reference_mask(model, monkeypatch, ring):
    W, chunk, T = 6, 4, 40
    tokens = _ids(T, seed=3)
    ref = _reference_logits(model, tokens, W, monkeypatch)
    if ring:
        cache = RingKVCache.build(model, 1, W, chunk, "fp32")
    else:
        cache = model.new_cache(1, T, "fp32")
        cache.window = W
    got = forward_chunked(model, tokens, cache=cache, q_chunk=chunk)
    torch.testing.assert_close(got, ref, **tol.forward(ref, model.config))
    full = model(tokens)   # the window does change outputs past W tokens
    assert not torch.allclose(full[:, W:], ref[:, W:], atol=1e-3)
    torch.testing.assert_close(full[:, :W], ref[:, :W], **tol.forward(ref, model.config))


@torch.inference_mode()
def test_window_forward_argument_without_cache_matches_reference(model, monkeypatch):
    tokens = _ids(20, seed=4)
    ref = _reference_logits(model, tokens, 5, monkeypatch)
    torch.testing.assert_close(model(tokens, window=5), ref, **tol.forward(ref, model.config))


@pytest.mark.parametrize("kind", ["fp32", "fp16", "q8_0", "q4_0", "nf4"])
def test_windowed_generation_matches_reference_greedy(model, monkeypatch, kind):
    """Every generated token is the argmax of the reference windowed forward over what precedes it."""
    W, prompt = 8, _ids(13, seed=5)
    seqs, gen = _greedy(model, prompt, 20, cache_kind=kind, decode_plan="fixed", decode_local_window=W, decode_q_chunk=4)
    assert gen.plan.ring and gen.plan.window == W and not gen.plan.exact
    full = torch.cat([prompt, torch.tensor([seqs[0][:-1]])], dim=1)
    with torch.inference_mode():
        ref = _reference_logits(model, full, W, monkeypatch)[0, prompt.shape[1] - 1 :]
    if kind == "fp32":
        assert ref.argmax(-1).tolist() == seqs[0]
    else:   # quantized keys/values: compare against the same cache kind through the plain windowed path
        plain = model.new_cache(1, 64, kind)
        plain.window = W
        with torch.inference_mode():
            logits = model(full, cache=plain)[0, prompt.shape[1] - 1 :]
        assert logits.argmax(-1).tolist() == seqs[0]


def test_window_warns_and_search_rejects_it(model):
    with pytest.warns(LocalWindowWarning, match="changes outputs"):
        Generator(model, GenerateConfig(decode_plan="fixed", decode_local_window=4))
    with pytest.raises(ValueError, match="decode_local_window"):
        beam_search(model, [[1, 2, 3]], GenerateConfig(num_beams=2, decode_plan="fixed", decode_local_window=4))
    with pytest.raises(ValueError, match="decode_local_window"):
        SpeculativeConfig(draft="prompt_lookup", decode_plan="fixed", decode_local_window=4)


# ---- ring buffer ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fp32", "q8_0", "q4_0"])
def test_ring_memory_is_flat_and_outputs_equal_plain_window(model, kind):
    """Generation runs past max_seq_len and many times the ring's capacity; nbytes never grows."""
    W, chunk, n = 8, 4, 60
    prompt = _ids(10, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LocalWindowWarning)
        gen = Generator(model, GenerateConfig(max_new_tokens=n, temperature=0.0, cache_kind=kind, max_seq_len=16,
                                              decode_plan="fixed", decode_local_window=W, decode_q_chunk=chunk))
    sizes, seq = [], []
    for tok in gen.generate_iter(prompt):
        sizes.append(gen.cache.nbytes)
        seq.append(tok)
    assert isinstance(gen.cache, RingKVCache) and gen.cache.capacity == W + chunk
    assert len(seq) == n and gen.cache.length == 10 + n - 1 > 5 * gen.cache.capacity
    assert len(set(sizes)) == 1
    assert sizes[0] == model.new_cache(1, W + chunk, kind).nbytes

    # The same greedy decode on a plain cache that keeps every slot and masks to the window.
    plain = model.new_cache(1, 10 + n, kind)
    plain.window = W
    with torch.inference_mode():
        logits = forward_chunked(model, prompt, cache=plain, last_only=True, q_chunk=chunk)
        expect = []
        for _ in range(n):
            expect.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[expect[-1]]]), cache=plain)
    assert seq == expect


def test_ring_ragged_batch_rows_equal_running_alone(model, prompts):
    """Left padding sits before each row's tokens, so a row's W newest slots are its W newest tokens."""
    cfg = dict(cache_kind="fp32", decode_plan="fixed", decode_local_window=5, decode_q_chunk=3, max_seq_len=8)
    batch, gen = _greedy(model, prompts, 25, **cfg)
    assert gen.plan.ring and gen.has_holes
    for row, prompt in enumerate(prompts):
        assert _greedy(model, [prompt], 25, **cfg)[0][0] == batch[row]


def test_ring_truncate_reorder_and_unsupported_caches(model):
    cache = RingKVCache.build(model, 2, 6, 4, "fp32")
    with torch.inference_mode():
        forward_chunked(model, _ids(30, batch=2), cache=cache, q_chunk=4)
        cache.truncate(27)                     # 3 of the last max_write=4 slots: still in the ring
        with pytest.raises(ValueError, match="roll back at most max_write=4"):
            cache.truncate(22)
        with pytest.raises(ValueError, match="at most 4 tokens per forward"):
            model(_ids(5, batch=2), cache=cache)
        cache.reorder(torch.tensor([1, 1]))
        assert cache.batch_size == 2
    with pytest.raises(ValueError, match="residual_len"):
        RingKVCache.build(model, 1, 6, 4, GenerateConfig(cache_kind="q8_0", residual_len=2).cache_spec())
    # The Generator then keeps a plain windowed cache (bounded by max_seq_len) and records ring=False.
    _, gen = _greedy(model, _ids(9), 3, cache_kind="q8_0", residual_len=2, decode_plan="fixed", decode_local_window=4)
    assert not gen.plan.ring and gen.cache.window == 4 and not isinstance(gen.cache, RingKVCache)


@torch.inference_mode()
def test_ring_truncate_then_rewrite_matches_plain(model):
    """Rolling back within the ring and writing other tokens gives what a plain windowed cache gives."""
    W, chunk = 5, 4
    ring = RingKVCache.build(model, 1, W, chunk, "fp32")
    plain = model.new_cache(1, 64, "fp32")
    plain.window = W
    first, second = _ids(23, seed=7), _ids(3, seed=8)
    for cache in (ring, plain):
        forward_chunked(model, first, cache=cache, q_chunk=chunk)
        cache.truncate(20)
    want = model(second, cache=plain)
    torch.testing.assert_close(model(second, cache=ring), want, **tol.forward(want, model.config))


# ---- plan resolution and validation -----------------------------------------------------------

def test_plan_resolution():
    auto = DecodePlan("auto")
    assert auto.resolve(512).q_chunk is None
    assert auto.resolve(AUTO_CHUNK_MID).q_chunk is None   # fits one chunk: the plain path
    assert auto.resolve(AUTO_CHUNK_MID + 1).q_chunk == AUTO_CHUNK_MID and auto.resolve(2048).q_chunk == AUTO_CHUNK_MID
    assert auto.resolve(4096).q_chunk == AUTO_CHUNK_LONG
    assert all(auto.resolve(n).window is None and auto.resolve(n).exact for n in (1, 600, 10_000))
    assert DecodePlan("auto", 100, 200, q_chunk=64).resolve(150).q_chunk == 64
    assert DecodePlan("none").resolve(10_000).q_chunk is None
    fixed = DecodePlan("fixed", q_chunk=128)
    assert fixed.resolve(100).q_chunk is None and fixed.resolve(129).q_chunk == 128   # one chunk: plain path
    windowed = DecodePlan("fixed", local_window=64).resolve(1000, ring_max_write=64)
    assert windowed.q_chunk == 64 and windowed.ring and not windowed.exact
    assert parse_plan("chunk=256,window=512") == DecodePlan("fixed", q_chunk=256, local_window=512)
    assert parse_plan("auto") == DecodePlan("auto") and parse_plan("none") == DecodePlan()


@pytest.mark.parametrize("fields, name", [
    ({"plan": "fast"}, "decode_plan"), ({"bucket_short": 0}, "decode_bucket_short"),
    ({"bucket_short": 600, "bucket_mid": 500}, "decode_bucket_mid"), ({"plan": "fixed", "q_chunk": 0}, "decode_q_chunk"),
    ({"plan": "fixed", "local_window": 0}, "decode_local_window"), ({"q_chunk": 64}, "decode_plan"),
])
def test_bad_plans_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        DecodePlan(**fields)


@pytest.mark.parametrize("fields, name", [
    ({"decode_plan": "fast"}, "decode_plan"), ({"decode_q_chunk": 0}, "decode_q_chunk"),
    ({"decode_q_chunk": 64}, "decode_plan"), ({"decode_bucket_short": 4096}, "decode_bucket_mid"),
])
def test_schema_rejects_bad_plan_settings(fields, name):
    with pytest.raises(ValidationError, match=name):
        GenerateSettings(prompts=["hi"], **fields)
    with pytest.raises(ValueError, match=f"GenerateConfig.{name}"):
        GenerateConfig(**fields)


def test_bench_settings_reject_bad_plan():
    with pytest.raises(ValidationError, match="decode plan 'chunk=x'"):
        BenchSettings(decode_plans=["none", "chunk=x"])
    assert BenchSettings(decode_plans=["auto", "chunk=4,window=8"]).decode_plans == ["auto", "chunk=4,window=8"]


# ---- bench grid and CLI -------------------------------------------------------------------------

def test_bench_grid_with_decode_plans(model):
    ids = _ids(64, seed=9)[0].tolist()
    grid = Grid(prompt_lens=(24,), cache_kinds=("fp32",), new_tokens=3, warmup=0, repeats=1,
                decode_plans=("none", "chunk=8", "chunk=8,window=6"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LocalWindowWarning)
        rows = {r["decode_plan"]: r for r in run_grid(model, ids, grid, progress=False)}
    assert rows["none"]["plan_q_chunk"] is None and rows["none"]["exact"]
    assert rows["chunk=8"]["plan_q_chunk"] == 8 and rows["chunk=8"]["exact"]
    windowed = rows["chunk=8,window=6"]
    assert windowed["plan_window"] == 6 and windowed["plan_ring"] and not windowed["exact"]
    assert windowed["cache_bytes"] < rows["none"]["cache_bytes"]   # 14 ring slots vs 27


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_cli_generate_records_the_plan(tiny_model):
    runner = CliRunner()
    base = ["generate", "hello there, a longer prompt", "--model", tiny_model, "--max-new-tokens", "4", "--json"]
    plain = runner.invoke(app, base)
    chunked = runner.invoke(app, [*base, "--decode-plan", "fixed", "--q-chunk", "2"])
    assert plain.exit_code == 0 and chunked.exit_code == 0, chunked.output
    a, b = json.loads(plain.stdout), json.loads(chunked.stdout)
    assert a["output_ids"] == b["output_ids"] and b["decode_plan"]["q_chunk"] == 2 and b["decode_plan"]["exact"]
    windowed = runner.invoke(app, [*base, "--decode-plan", "fixed", "--local-window", "3"])
    assert windowed.exit_code == 0 and "changes outputs" in windowed.stderr
    assert json.loads(windowed.stdout)["decode_plan"] | {"exact": False, "window": 3, "ring": True} == \
        json.loads(windowed.stdout)["decode_plan"]
    bad = runner.invoke(app, [*base, "--q-chunk", "8"])
    assert bad.exit_code == 2 and "--decode-plan" in bad.output


def test_generate_run_records_the_plan_and_warns(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    path = tmp_path / "m.yaml"
    write_manifest(path, """\
      - id: w
        mode: generate
        generate:
          prompts: ["one two three four five six seven"]
          max_new_tokens: 12
          max_seq_len: 8
          temperature: 0.0
          decode_plan: fixed
          decode_q_chunk: 2
          decode_local_window: 4
""", model=tiny_model, name="plans")
    r = CliRunner().invoke(app, ["run", str(path)])
    assert r.exit_code == 0, r.output
    assert "changes outputs" in r.output
    record = tmp_path / "runs" / "plans" / "t" / "w"
    result = json.loads((record / "result.json").read_text())
    plan = result["prompts"][0]["decode_plan"]
    assert plan["window"] == 4 and plan["ring"] and plan["q_chunk"] == 2 and not plan["exact"]
    assert result["summary"]["exact"] is False and len(result["prompts"][0]["output_ids"]) == 12
    assert "changes outputs" in (record / "log.txt").read_text()


def test_example_manifest_validates():
    r = CliRunner().invoke(app, ["validate", "manifests/decode_plans.yaml"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("kind", ["fp32", "q4_0"])
def test_ring_equals_plain_window_in_ragged_multi_turn_batches(model, prompts, monkeypatch, kind):
    """Same Generator, ring buffer vs a plain cache masked to the window (ring construction
    refused), over two turns of ragged rows: holes, pending tokens, wrap-around."""
    cfg = dict(cache_kind=kind, decode_plan="fixed", decode_local_window=6, decode_q_chunk=4, max_seq_len=128)
    turns = [prompts, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10], [11, 12, 13]]]

    def session():
        seqs, gen = _greedy(model, turns[0], 15, **cfg)
        return [seqs, gen.run(turns[1]).sequences], gen

    ring, gen = session()
    assert gen.plan.ring
    with monkeypatch.context() as m:
        m.setattr(RingKVCache, "build", classmethod(lambda *a, **k: (_ for _ in ()).throw(ValueError("off"))))
        plain, gen = session()
    assert not gen.plan.ring
    assert ring == plain


def test_schema_rejects_a_window_with_search_or_speculative(tmp_path, tiny_model, monkeypatch):
    with pytest.raises(ValidationError, match="decode_local_window"):
        GenerateSettings(prompts=["hi"], num_beams=2, decode_plan="fixed", decode_local_window=4)
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    path = tmp_path / "m.yaml"
    write_manifest(path, """\
      - id: s
        mode: speculative
        speculative: {prompts: ["one two"], max_new_tokens: 4, decode_plan: fixed, decode_local_window: 4}
""", model=tiny_model, name="plans")
    r = CliRunner().invoke(app, ["run", str(path)])
    assert r.exit_code == 2 and "decode_local_window" in r.output
    assert not (tmp_path / "runs" / "plans" / "t" / "s").exists()


def test_bench_command_takes_decode_plans(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    args = ["bench", "--model", tiny_model, "--prompt-lens", "12", "--new-tokens", "3", "--warmup", "0",
            "--repeats", "1", "--decode-plans", "none;chunk=4;chunk=4,window=6", "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    cells = json.loads(r.stdout)
    assert [(c["decode_plan"], c["plan_q_chunk"], c["exact"]) for c in cells] == \
        [("none", None, True), ("chunk=4", 4, True), ("chunk=4,window=6", 4, False)]
    bad = CliRunner().invoke(app, [*args[:-3], "--decode-plans", "chunk=0"])
    assert bad.exit_code == 2 and "--decode-plans" in bad.output and "decode_q_chunk" in bad.output


def test_auto_batch_estimate_counts_the_chunk(model):
    from caramba.infer.batched import row_cost_bytes

    whole = row_cost_bytes(model, GenerateConfig(max_seq_len=256), 200)
    chunked = row_cost_bytes(model, GenerateConfig(max_seq_len=256, decode_plan="fixed", decode_q_chunk=50), 200)
    assert chunked["cache_bytes"] == whole["cache_bytes"]
    assert chunked["activation_bytes"] < whole["activation_bytes"] / 3
