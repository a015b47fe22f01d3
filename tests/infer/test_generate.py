"""Generation: greedy == a hand-rolled argmax loop, ragged batches, stops, multi-turn sessions,
streaming, seeded sampling, overflow checks and config validation."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from caramba.infer import CacheOverflowError, GenerateConfig, GenerationResult, Generator, generate
from conftest import TINY, make_model

V = TINY["vocab_size"]


def greedy_reference(model, prompt: list[int], n: int, eos: int | None = None, penalty: float = 1.0) -> list[int]:
    """Argmax over a full no-cache forward of the whole sequence, one token at a time."""
    seq = list(prompt)
    out: list[int] = []
    process = RepetitionPenaltyLogitsProcessor(penalty) if penalty != 1.0 else None
    for _ in range(n):
        ids = torch.tensor([seq])
        logits = model(ids)[:, -1]
        if process is not None:
            logits = process(ids, logits)
        tok = int(logits.argmax(-1))
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


def greedy(**kw) -> GenerateConfig:
    return GenerateConfig(**{"temperature": 0.0, "max_seq_len": 64, **kw})


def count_forwards(monkeypatch, model) -> list[tuple[int, ...]]:
    """Record the token shape of every forward a decoder runs, through whichever backend it chose
    (caramba.model.backend: the C step's or the model's own)."""
    from caramba.model.backend import CStep, TorchStep

    calls: list[tuple[int, ...]] = []
    for cls in (CStep, TorchStep):
        def forward(self, tokens, *args, _real=cls.__call__, **kwargs):
            if self.model is model:
                calls.append(tuple(tokens.shape))
            return _real(self, tokens, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", forward)
    return calls


class CharTokenizer:
    """A stand-in tokenizer: token i decodes to '<i>'."""

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    def decode(self, ids) -> str:
        return "".join(f"<{i}>" for i in ids)


# ---- greedy ------------------------------------------------------------------------------------

def test_greedy_equals_hand_rolled_argmax_loop(model, prompts):
    for prompt in prompts:
        out = generate(model, [prompt], greedy(max_new_tokens=10))
        assert out[0, len(prompt):].tolist() == greedy_reference(model, prompt, 10)


def test_greedy_with_repetition_penalty_equals_hf_processor_loop(model, prompts):
    prompt = prompts[1]
    got = generate(model, [prompt], greedy(max_new_tokens=12, repetition_penalty=1.5))[0, len(prompt):].tolist()
    assert got == greedy_reference(model, prompt, 12, penalty=1.5)
    assert got != greedy_reference(model, prompt, 12)  # the penalty really changed something


def test_stateless_generate_returns_prompt_then_new_tokens(model):
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    out = generate(model, prompt, temperature=0, max_new_tokens=7, max_seq_len=32)
    assert out.shape == (2, 5 + 7) and out.dtype == torch.long
    assert torch.equal(out[:, :5], prompt)
    for row in range(2):
        assert out[row, 5:].tolist() == greedy_reference(model, prompt[row].tolist(), 7)
    # a 1-D prompt is one row; a config plus keyword overrides merge
    one = generate(model, prompt[0], GenerateConfig(max_new_tokens=3, max_seq_len=32), temperature=0)
    assert one.shape == (1, 8) and torch.equal(one[0], out[0, :8])


def test_max_new_tokens_is_respected(model, prompts):
    for n in (1, 2, 9):
        res = Generator(model, greedy(max_new_tokens=n)).run(prompts)
        assert [len(s) for s in res.sequences] == [n, n, n]
        assert res.finish_reasons == ["length"] * 3
        assert res.decode_steps == n - 1
        assert res.n_generated == 3 * n


# ---- ragged batches ------------------------------------------------------------------------------

def test_ragged_batch_greedy_equals_each_prompt_alone(model, prompts):
    res = Generator(model, greedy(max_new_tokens=10)).run(prompts)
    for prompt, seq in zip(prompts, res.sequences):
        assert seq == greedy_reference(model, prompt, 10)


def test_ragged_batch_tensor_with_attention_mask_equals_lists(model, prompts):
    width = max(map(len, prompts))
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids[0, 0] = 42  # what padding holds must not matter
    from_tensor = Generator(model, greedy(max_new_tokens=6)).generate(ids, mask)
    from_lists = Generator(model, greedy(max_new_tokens=6)).generate(prompts)
    assert torch.equal(from_tensor[:, width:], from_lists[:, width:])


def test_right_padded_attention_mask_is_rejected(model):
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left-padded"):
        Generator(model, greedy(max_new_tokens=2)).generate(ids, mask)


def pick_early_eos(model, prompts, n=12) -> tuple[int, list[list[int]]]:
    """An eos id that row 0 emits early, so rows stop at different times."""
    alone = [greedy_reference(model, p, n) for p in prompts]
    eos = alone[0][2]
    return eos, [greedy_reference(model, p, n, eos=eos) for p in prompts]


def test_ragged_batch_rows_stop_on_their_own_eos(model, prompts):
    eos, expected = pick_early_eos(model, prompts)
    res = Generator(model, greedy(max_new_tokens=12, eos_token_id=eos)).run(prompts)
    assert res.sequences == expected
    assert len({len(s) for s in expected}) > 1, "pick prompts whose rows stop at different times"
    for seq, reason in zip(res.sequences, res.finish_reasons):
        assert reason == ("eos" if seq[-1] == eos else "length")
        assert eos not in seq[:-1]
    assert res.finish_reasons[0] == "eos" and len(res.sequences[0]) <= 3
    # generate() right-pads finished rows with the pad id (the eos id by default)
    out = Generator(model, greedy(max_new_tokens=12, eos_token_id=eos)).generate(prompts)
    width = max(map(len, prompts))
    assert out.shape == (3, width + max(map(len, expected)))
    first = out[0, width:].tolist()
    assert first[: len(expected[0])] == expected[0] and set(first[len(expected[0]):]) <= {eos}


def test_eos_list_and_explicit_pad_id(model, prompts):
    eos, expected = pick_early_eos(model, prompts)
    cfg = greedy(max_new_tokens=12, eos_token_id=[V - 1, eos], pad_token_id=V - 2)
    out = Generator(model, cfg).generate(prompts)
    width = max(map(len, prompts))
    n0 = len(expected[0])
    assert out[0, width : width + n0].tolist() == expected[0]
    assert (out[0, width + n0 :] == V - 2).all()


def test_all_rows_finishing_ends_the_loop_early(monkeypatch):
    model = make_model()
    prompt = [3, 1, 4, 1, 5]
    ref = greedy_reference(model, prompt, 5)
    calls = count_forwards(monkeypatch, model)
    res = Generator(model, greedy(max_new_tokens=20, eos_token_id=ref[2])).run([prompt])
    k = ref.index(ref[2]) + 1
    assert res.sequences == [ref[:k]] and res.finish_reasons == ["eos"]
    assert len(calls) == k  # prefill + (k - 1) decode steps; the EOS itself is never fed


# ---- stop sequences ------------------------------------------------------------------------------

def test_token_id_stop_sequence_stops_a_row(model, prompts):
    free = Generator(model, greedy(max_new_tokens=12)).run(prompts).sequences
    stop = free[1][3:5]
    k = next(i for i in range(2, 13) if free[1][i - 2 : i] == stop)
    res = Generator(model, greedy(max_new_tokens=12, stop_sequences=[stop])).run(prompts)
    assert res.sequences[1] == free[1][:k] and res.finish_reasons[1] == "stop_sequence"
    for row in (0, 2):  # the other rows are unaffected unless they emit the same pair
        if not any(free[row][i - 2 : i] == stop for i in range(2, 13)):
            assert res.sequences[row] == free[row] and res.finish_reasons[row] == "length"


def test_string_stop_sequence_with_a_tokenizer(model, prompts):
    free = Generator(model, greedy(max_new_tokens=12)).run(prompts).sequences
    a, b = free[0][4], free[0][5]
    stop = f"{a}><{b}"  # spans a token boundary, matches neither token alone
    text = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    k = next(i for i in range(1, 13) if stop in text(free[0][:i]))
    gen = Generator(model, greedy(max_new_tokens=12, stop_sequences=[stop]), tokenizer=CharTokenizer())
    res = gen.run(prompts)
    assert res.sequences[0] == free[0][:k] and res.finish_reasons[0] == "stop_sequence"
    for row in (1, 2):
        if stop not in text(free[row]):
            assert res.sequences[row] == free[row]


def test_string_stop_sequences_need_a_tokenizer(model):
    with pytest.raises(ValueError, match="need a tokenizer"):
        Generator(model, greedy(stop_sequences=["\n\n"]))


def test_tokenizer_eos_is_used_when_config_has_none(model, prompts):
    eos, expected = pick_early_eos(model, prompts)
    gen = Generator(model, greedy(max_new_tokens=12), tokenizer=CharTokenizer(eos_token_id=eos))
    assert gen.run(prompts).sequences == expected


# ---- multi-turn sessions -------------------------------------------------------------------------

def test_multi_turn_equals_one_fresh_generation_on_the_concatenation(monkeypatch):
    model = make_model()
    turn1, turn2 = [7, 3, 9, 11, 2], [40, 41, 42]
    gen = Generator(model, greedy(max_new_tokens=6))
    out1 = gen.generate(turn1)[0, len(turn1):].tolist()
    assert gen.cache.length == len(turn1) + 6 - 1      # the last token is pending, not yet cached
    calls = count_forwards(monkeypatch, model)
    out2 = gen.generate(turn2)[0, len(turn2):].tolist()
    assert calls[0] == (1, 1 + len(turn2))              # prefill = pending token + the new prompt only
    assert calls[1:] == [(1, 1)] * 5
    assert gen.cache.length == len(turn1) + 6 + len(turn2) + 6 - 1
    fresh = greedy_reference(model, turn1 + out1 + turn2, 6)
    assert out2 == fresh
    assert out2 != greedy_reference(model, turn2, 6)    # the first turn really is in context


def test_multi_turn_ragged_batch_with_early_eos_and_repetition_penalty(model, prompts):
    cfg = dict(max_new_tokens=8, repetition_penalty=1.3)
    # An eos id that row 0 emits early under the penalty while another row runs to the length limit.
    unstopped = Generator(model, greedy(**cfg)).run(prompts).sequences
    eos = next(t for t in unstopped[0][:4] if any(t not in row for row in unstopped[1:]))
    gen = Generator(model, greedy(eos_token_id=eos, **cfg))
    first = gen.run(prompts).sequences
    assert any(s[-1] == eos for s in first) and any(s[-1] != eos for s in first)
    turn2 = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    second = gen.run(turn2).sequences
    for p, o, q, got in zip(prompts, first, turn2, second):
        assert got == greedy_reference(model, p + o + q, 8, eos=eos, penalty=1.3)


def test_reset_forgets_the_conversation(model):
    gen = Generator(model, greedy(max_new_tokens=5))
    alone = gen.generate([9, 8, 7])
    gen.generate([1, 2])
    gen.reset()
    assert gen.cache is None
    assert torch.equal(gen.generate([9, 8, 7]), alone)


def test_batch_size_change_needs_reset(model):
    gen = Generator(model, greedy(max_new_tokens=2))
    gen.generate([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="call reset"):
        gen.generate([[1, 2]])


def test_empty_rows_are_rejected(model):
    with pytest.raises(ValueError, match="at least one input token"):
        Generator(model, greedy(max_new_tokens=2)).generate([[1, 2], []])


# ---- streaming -----------------------------------------------------------------------------------

def test_generate_iter_streams_the_same_ids(model, prompts):
    cfg = greedy(max_new_tokens=9)
    single = list(Generator(model, cfg).generate_iter(prompts[0]))
    assert all(isinstance(t, int) for t in single)
    assert single == Generator(model, cfg).generate(prompts[0])[0, len(prompts[0]):].tolist()

    eos, expected = pick_early_eos(model, prompts)
    steps = list(Generator(model, greedy(max_new_tokens=12, eos_token_id=eos)).generate_iter(prompts))
    assert len(steps) == max(map(len, expected))
    for row in range(3):
        streamed = [s[row] for s in steps]
        n = len(expected[row])
        assert streamed[:n] == expected[row] and streamed[n:] == [None] * (len(steps) - n)


def test_run_on_token_callback_sees_every_token_in_order(model, prompts):
    seen: list[tuple[int, int]] = []
    res = Generator(model, greedy(max_new_tokens=4)).run(prompts, on_token=lambda r, t: seen.append((r, t)))
    assert isinstance(res, GenerationResult)
    for row in range(3):
        assert [t for r, t in seen if r == row] == res.sequences[row]
    assert res.prefill_s > 0 and res.decode_s > 0 and res.decode_tok_s > 0


# ---- sampling ------------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_seed_dependent(model, prompts):
    kw = dict(max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, max_seq_len=64)
    a = generate(model, prompts, seed=1, **kw)
    b = generate(model, prompts, seed=1, **kw)
    c = generate(model, prompts, seed=2, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, generate(model, prompts, temperature=0, max_new_tokens=16, max_seq_len=64))
    # a Generator's reset() restarts its random stream
    gen = Generator(model, GenerateConfig(seed=1, **kw))
    first = gen.generate(prompts)
    gen.reset()
    assert torch.equal(gen.generate(prompts), first) and torch.equal(first, a)


def test_top_k_1_sampling_is_greedy(model, prompts):
    sampled = generate(model, prompts, temperature=1.3, top_k=1, max_new_tokens=8, seed=0, max_seq_len=64)
    assert torch.equal(sampled, generate(model, prompts, temperature=0, max_new_tokens=8, max_seq_len=64))


# ---- capacity ------------------------------------------------------------------------------------

def test_overflow_raises_before_any_forward(monkeypatch):
    model = make_model()
    calls = count_forwards(monkeypatch, model)
    gen = Generator(model, greedy(max_new_tokens=6, max_seq_len=10))
    with pytest.raises(CacheOverflowError, match="max_seq_len=10"):
        gen.generate([1, 2, 3, 4, 5, 6])          # needs 6 + 6 - 1 = 11 slots
    with pytest.raises(CacheOverflowError):
        list(gen.generate_iter([1, 2, 3, 4, 5, 6]))
    assert calls == []
    gen = Generator(model, greedy(max_new_tokens=5, max_seq_len=10))
    assert gen.generate([1, 2, 3, 4, 5, 6]).shape == (1, 11)   # exactly 10 slots is enough
    assert gen.cache.length == 10


def test_overflow_in_a_later_turn_leaves_the_session_usable(monkeypatch):
    model = make_model()
    gen = Generator(model, greedy(max_new_tokens=4, max_seq_len=20))
    turn1 = [5, 4, 3, 2]
    out1 = gen.generate(turn1)[0, 4:].tolist()
    calls = count_forwards(monkeypatch, model)
    with pytest.raises(CacheOverflowError):
        gen.generate(list(range(10, 22)))         # 7 cached + 1 pending + 12 + 3 > 20
    assert calls == [] and gen.cache.length == 7
    turn2 = [30, 31]
    out2 = gen.generate(turn2)[0, 2:].tolist()
    assert out2 == greedy_reference(model, turn1 + out1 + turn2, 4)


# ---- config validation -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "field,value",
    [("max_new_tokens", 0), ("temperature", -0.5), ("top_k", 0), ("top_p", 0.0), ("top_p", 1.5),
     ("repetition_penalty", 0.0), ("max_seq_len", 0)],
)
def test_generate_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"GenerateConfig.{field}={value!r}"):
        GenerateConfig(**{field: value})


def test_generate_config_accepts_edge_values():
    cfg = GenerateConfig(temperature=0, top_k=1, top_p=1.0, cache_kind="BF16", eos_token_id=[1, 2])
    assert cfg.sampling.greedy and cfg.cache_kind == "bf16" and cfg.eos_ids() == [1, 2]
    assert GenerateConfig(eos_token_id=7).eos_ids() == [7] and GenerateConfig().eos_ids() == []


def test_seen_tokens_ignore_padding_that_shares_an_id(model):
    """Repetition-penalty bookkeeping must not depend on the order padding and real tokens are written."""
    gen = Generator(model, greedy(max_new_tokens=2, repetition_penalty=1.2))
    gen._start_turn(2)
    tokens = torch.tensor([[7, 7, 7, 9], [3, 3, 5, 5]])
    mask = torch.tensor([[True, False, False, True], [False, True, True, False]])
    gen._track_seen(tokens, mask)
    assert gen.seen[0].nonzero().flatten().tolist() == [7, 9]
    assert gen.seen[1].nonzero().flatten().tolist() == [3, 5]
    gen._track_seen(torch.tensor([[9], [1]]), torch.tensor([[False], [True]]))
    assert gen.seen[0].nonzero().flatten().tolist() == [7, 9]   # already seen stays seen
    assert gen.seen[1].nonzero().flatten().tolist() == [1, 3, 5]
