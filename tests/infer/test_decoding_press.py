"""Decoding-time compression (press_interval / press_target, caramba.infer.decoding_press) against
a plain-torch reference: the whole cache kept, decoding greedily, and every `interval` steps the
reference scores the visible tokens itself (knorm, keydiff, streaming_llm from the keys; tova and
snapkv from the queries it recorded) and hides all but `target` per head. Survivors keep their
RoPE positions in the reference by construction, so equal tokens and logits prove the positions,
the timing and the eviction. Also: the cache's bytes at each interval, the C step, settings."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from caramba.infer import GenerateConfig, Generator, SpeculativeConfig
from caramba.infer.state import DecodeState
from caramba.model import fast_decode
from caramba.model.backend import TorchStep
from caramba.options import OptionError
from caramba.press import PressConfig
from conftest import make_model
from test_cli import invoke
from test_eval import LENGTH, loaded, long_tiny  # noqa: F401 (fixtures)
from test_evict import MaskedLayer
from test_press_modes import prompt

PROMPT, NEW, INTERVAL, TARGET, WINDOW = 40, 30, 9, 24, 4


@pytest.fixture
def model():
    m = make_model(seed=7, n_layers=3, n_heads=4, n_kv_heads=2)
    m.fast_decode = False
    return m


class Recording(MaskedLayer):
    """The reference layer, also keeping every post-RoPE query it was asked with."""

    queries: list

    def attend(self, q, k, v, mask, causal):
        self.queries.append(q.float())
        return super().attend(q, k, v, mask, causal)


def reference_scores(method: str, layer: Recording, keys: torch.Tensor, vis: torch.Tensor, groups: int) -> torch.Tensor:
    """Scores [KVH, n] of the n visible tokens (vis [KVH, n] slot indices, in order) per head."""
    KVH = keys.shape[1]
    out = []
    for h in range(KVH):
        k = keys[0, h, vis[h]]                                          # [n, D]
        n, D = k.shape
        if method == "knorm":
            s = -k.norm(dim=-1)
        elif method == "keydiff":
            s = -F.cosine_similarity(k, F.normalize(k, dim=-1).mean(dim=0, keepdim=True), dim=-1)
        elif method == "streaming_llm":
            s = torch.ones(n)
            s[4: 4 + n - TARGET] = 0
        else:
            W = 1 if method == "tova" else WINDOW
            heads = range(groups * KVH) if method == "tova" else range(h * groups, (h + 1) * groups)
            qs = torch.stack([torch.cat([q[0, j, -1:] for q in layer.queries[-W:]]) for j in heads])   # [G, W, D]
            # Query head j reads KV head j // groups (tova keeps the same tokens in every head).
            kj = torch.stack([keys[0, j // groups, vis[j // groups]] for j in heads])                   # [G, n, D]
            logits = qs @ kj.transpose(1, 2) / math.sqrt(D)             # window query i sees keys up to n - W + i
            logits = logits.masked_fill(torch.ones(W, n, dtype=torch.bool).triu(n - W + 1), float("-inf"))
            a = logits.softmax(-1)[..., : n - W].mean(dim=1)            # [G, n - W]
            if method == "snapkv":
                a = F.avg_pool1d(a[:, None], 5, padding=2, stride=1)[:, 0]
            s = torch.cat([a.mean(dim=0), torch.full((W,), float("inf"))])
        out.append(s)
    return out


def reference(model, ids: torch.Tensor, method: str) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and logits over the whole cache, hiding all but TARGET visible tokens per
    head after every INTERVAL-th decode step."""
    cache = model.new_cache(1, PROMPT + NEW, "fp32")
    state = DecodeState(model, cache)
    t = state.prefill(ids).argmax(-1)
    groups = model.config.n_heads // cache.layers[0].n_kv_heads
    for layer in cache.layers:
        layer.__class__ = Recording
        layer.hidden, layer.queries = torch.zeros(1, layer.n_kv_heads, 0, dtype=torch.bool), []
    tokens, logits = [int(t)], []
    for step in range(1, NEW):
        out = state.step(t)
        logits.append(out)
        if step % INTERVAL == 0:
            for layer in cache.layers:
                L = layer.length
                hidden = F.pad(layer.hidden, (0, L - layer.hidden.shape[-1]))
                keys, _ = layer.contents(L)
                vis = [(~hidden[0, h]).nonzero().flatten() for h in range(layer.n_kv_heads)]
                for h, s in enumerate(reference_scores(method, layer, keys, vis, groups)):
                    keep = s.topk(TARGET).indices
                    drop = torch.ones(len(vis[h]), dtype=torch.bool)
                    drop[keep] = False
                    hidden[0, h, vis[h][drop]] = True
                layer.hidden = hidden
        t = out.argmax(-1)
        tokens.append(int(t))
    return tokens, logits


def decode_pressed(model, ids, method, **extra):
    config = GenerateConfig(max_new_tokens=NEW, temperature=0.0, max_seq_len=PROMPT + NEW, press=method,
                            press_ratio=0.0, press_interval=INTERVAL, press_target=TARGET, press_window=WINDOW, **extra)
    gen = Generator(model, config)
    logits = []
    real = gen._forward
    gen._forward = lambda tokens, mask: logits.append(real(tokens, mask)) or logits[-1]
    out = gen.generate(ids)[0, PROMPT:].tolist()
    return gen, out, logits[1:]   # the decode steps' logits


@pytest.mark.parametrize("method", ["knorm", "keydiff", "streaming_llm", "tova", "snapkv"])
def test_decoding_press_equals_the_masked_full_cache(model, method):
    ids = prompt(model)
    want, want_logits = reference(model, ids, method)
    gen, got, got_logits = decode_pressed(model, ids, method)
    assert got == want
    assert gen.decoding.compressions == (NEW - 1) // INTERVAL == 3
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)   # fp32: the same sums in another order
    # Positions: every token was fed at its own position; the dropped ones are counted, not slotted.
    fed = PROMPT + NEW - 1
    assert gen.state.next_pos.tolist() == [fed]
    assert gen.state.evicted.tolist() == [fed - gen.state.cache.length]
    assert gen.state.cache.length == TARGET + (NEW - 1) % INTERVAL


def test_cache_bytes_shrink_at_each_interval_to_the_kept_tokens(model):
    ids = prompt(model)
    config = GenerateConfig(max_new_tokens=NEW, temperature=0.0, max_seq_len=PROMPT + NEW, press="knorm",
                            press_ratio=0.0, press_interval=INTERVAL, press_target=TARGET)
    gen = Generator(model, config)
    per_slot = None
    seen = []
    for i, _ in enumerate(gen.generate_iter(ids)):
        cache = gen.state.cache
        per_slot = per_slot or cache.nbytes // cache.max_seq_len
        seen.append((cache.length, cache.max_seq_len, cache.nbytes))
    whole = PROMPT + NEW
    # Token i is yielded after i decode steps (the prefill gave the first); compressions after steps 9, 18, 27.
    for step, (length, slots, nbytes) in enumerate(seen):
        n = step // INTERVAL
        room_used = n * INTERVAL
        if n == 0:
            assert (length, slots) == (PROMPT + step, whole)
        else:   # target survivors, then the room that was left when it compressed
            assert length == TARGET + step - room_used
            assert slots == TARGET + whole - (PROMPT + room_used)
        assert nbytes == slots * per_slot
    assert [b for _, _, b in seen] == sorted((b for _, _, b in seen), reverse=True)


def test_query_methods_decode_their_watched_steps_on_torch_and_the_rest_on_the_c_step(model):
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    ids = torch.cat([prompt(model, seed=1), prompt(model, seed=2)])
    outs = {}
    for method in ("snapkv", "knorm"):
        for fast in (True, False):
            model.fast_decode = fast
            calls = []
            real = fast_decode.step
            fast_decode.step = lambda *a, **k: calls.append(1) or real(*a, **k)
            try:
                outs[method, fast] = Generator(model, GenerateConfig(
                    max_new_tokens=NEW, temperature=0.0, max_seq_len=PROMPT + NEW, cache_kind="q8_0", press=method,
                    press_ratio=0.0, press_interval=INTERVAL, press_target=TARGET, press_window=WINDOW)).generate(ids)
            finally:
                fast_decode.step = real
            watched = 3 * WINDOW if method == "snapkv" else 0
            assert len(calls) == (NEW - 1 - watched if fast else 0), (method, fast)
        assert torch.equal(outs[method, True], outs[method, False])


def test_expected_attention_and_a_prefill_press_compose(model):
    ids = torch.cat([prompt(model, seed=3), prompt(model, seed=4)])
    config = GenerateConfig(max_new_tokens=NEW, temperature=0.0, max_seq_len=PROMPT + NEW, press="expected_attention",
                            press_ratio=0.5, press_interval=INTERVAL, press_target=TARGET)
    gen = Generator(model, config)
    gen.generate(ids)
    # the prefill kept 20 of 40; the first interval grows that to 29 > 24; later ones press to 24
    assert gen.decoding.compressions == 3
    assert gen.state.cache.length == TARGET + (NEW - 1) % INTERVAL
    assert gen.state.evicted.tolist() == [PROMPT + NEW - 1 - gen.state.cache.length] * 2


def test_rows_that_finished_keep_their_tokens_under_a_query_method(model):
    """A row that stopped before a compression has holes where the window would be: snapkv leaves
    it whole rather than score padding (its later turns still see it all)."""
    ids = torch.cat([prompt(model, seed=5), prompt(model, seed=6)])
    probe = Generator(model, GenerateConfig(max_new_tokens=12, temperature=0.0, max_seq_len=PROMPT + NEW,
                                            press="snapkv", press_ratio=0.0, press_interval=INTERVAL,
                                            press_target=TARGET, press_window=WINDOW))
    stop = probe.generate(ids)[0, PROMPT + 3].item()   # row 0's 4th token ends it (if row 1 differs)
    config = GenerateConfig(max_new_tokens=12, temperature=0.0, max_seq_len=PROMPT + NEW, press="snapkv",
                            press_ratio=0.0, press_interval=INTERVAL, press_target=TARGET, press_window=WINDOW,
                            eos_token_id=stop)
    gen = Generator(model, config)
    out = gen.generate(ids)
    if stop in out[1, PROMPT:PROMPT + 10].tolist():
        pytest.skip("both rows emit the stop token")
    valid = gen.state.valid_slots().sum(dim=1).tolist()
    assert gen.decoding.compressions == 1
    assert valid[0] == PROMPT + out[0, PROMPT:].tolist().index(stop) + 1 and valid[1] == TARGET + 2


def test_decoding_press_settings_exit_2_naming_the_field(tmp_path):
    for bad, field in [(dict(press_interval=8), "press_interval"),
                       (dict(press="pyramidkv", press_interval=80), "press_interval"),
                       (dict(press="observed_attention", press_interval=80), "press_interval"),
                       (dict(press="knorm", press_interval=80, press_adaptive=True), "press_interval"),
                       (dict(press="snapkv", press_interval=64), "press_interval"),
                       (dict(press="knorm", press_interval=0), "press_interval"),
                       (dict(press="knorm", press_interval=8, press_target=0), "press_target")]:
        with pytest.raises(OptionError, match=field):
            GenerateConfig(**bad)
    with pytest.raises(OptionError, match="press_interval.*speculative"):
        SpeculativeConfig(draft="prompt_lookup", press="knorm", press_interval=8)
    with pytest.raises(ValueError, match="beam"):
        GenerateConfig(press="knorm", press_ratio=0.0, press_interval=8, num_beams=2)
    r = invoke("generate", "hello", "--model", "tiny", "--press", "knorm", "--press-interval", "0")
    assert r.exit_code == 2 and "press-interval" in r.output.replace("_", "-") and "Traceback" not in r.output, r.output
    r = invoke("generate", "hello", "--model", "tiny", "--press", "knorm", "--press-interval", "8", "--speculative",
               "prompt_lookup")
    assert r.exit_code == 2 and "press-interval" in r.output.replace("_", "-") and "Traceback" not in r.output, r.output


def test_the_press_form_carries_decoding_time_compression():
    p = PressConfig.parse("knorm@0/64:512")
    assert (p.method, p.ratio, p.interval, p.target, p.active, p.decoding) == ("knorm", 0.0, 64, 512, False, True)
    assert PressConfig.parse(p.describe()) == p
    assert PressConfig.parse("snapkv@0.5").describe() == "snapkv@0.5"
    for bad in ("knorm@0/64", "knorm@0/x:5"):
        with pytest.raises(ValueError, match="INTERVAL:TARGET"):
            PressConfig.parse(bad)


def test_eval_answers_with_decoding_time_compression_equal_the_generator(loaded):  # noqa: F811 (fixture)
    """An eval candidate's answer steps run the same compression as the Generator: one sample,
    the context and question fed (unpressed: press_ratio 0), then every 3 answer tokens the
    cache is pressed to 500; the tokens equal the Generator's over the same prompt."""
    from caramba.cache import CachePolicy
    from caramba.evaluation import tasks as task_suite
    from caramba.evaluation.task_eval import Candidate, answer_tasks

    [sample] = task_suite.make_samples("niah_single", LENGTH, 1, 0, loaded.tokenizer, chat=False)
    press = PressConfig(method="knorm", ratio=0.0, interval=3, target=500)
    fp32 = CachePolicy.build("fp32")
    results, _ = answer_tasks(loaded.model, loaded.tokenizer, [sample], [Candidate("pressed", fp32, None, press)],
                              Candidate("fp32", fp32), prefill="own", batch_size=1)
    got = results[0].answers[0].output_ids
    n = len(sample.prompt_ids)
    config = GenerateConfig(max_new_tokens=len(got), temperature=0.0, max_seq_len=n + sample.max_new_tokens,
                            press="knorm", press_ratio=0.0, press_interval=3, press_target=500, eos_token_id=None)
    gen = Generator(loaded.model, config)
    want = gen.generate(torch.tensor([sample.prompt_ids]))[0, n:].tolist()
    assert len(got) >= 7 and gen.decoding.compressions >= 2
    assert got == want


def test_a_caller_that_stops_mid_watch_gets_the_c_step_and_no_observers_back(model):
    config = GenerateConfig(max_new_tokens=NEW, temperature=0.0, max_seq_len=PROMPT + NEW, press="snapkv",
                            press_ratio=0.0, press_interval=INTERVAL, press_target=TARGET, press_window=WINDOW)
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    model.__dict__.pop("fast_decode")            # the class default: the C step
    gen = Generator(model, config)
    it = gen.generate_iter(prompt(model))
    for _ in range(INTERVAL - 1):   # the watched steps have started: observers on, the torch path
        next(it)
    assert gen.decoding._observing is not None and isinstance(gen.state.backend, TorchStep)
    assert all(layer.observer is not None for layer in gen.state.cache.layers)
    it.close()
    assert isinstance(gen.state.backend, fast_decode.CStep)     # the session's own backend is back
    assert all(layer.observer is None for layer in gen.state.cache.layers)
