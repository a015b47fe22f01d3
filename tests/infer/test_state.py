"""The shared decoding state (caramba.infer.state) and stop checker (caramba.infer.stops), directly:
per-row positions of ragged rows, holes, the pending token, rollback, reorder; eos, id and string
stops, finish reasons."""

from __future__ import annotations

import pytest
import torch

from caramba.cache.layer import CacheOverflowError
from caramba.cache.ring import RingKVCache
from caramba.infer import GenerateConfig
from caramba.infer.padding import left_pad
from caramba.infer.state import DecodeState
from caramba.infer.stops import StopChecker, fill_eos_from_tokenizer, pad_id_for
from conftest import TINY

V = TINY["vocab_size"]
PAD = 0
# Batched vs one-row matmuls differ by float rounding only.
TOL = dict(atol=1e-4, rtol=1e-4)


def state(model, batch: int = 2, slots: int = 32, **cfg) -> DecodeState:
    return DecodeState.for_config(model, batch, GenerateConfig(max_seq_len=slots, **cfg))


@torch.inference_mode()
def alone(model, seq: list[int]) -> torch.Tensor:
    """Next-token logits [V] of one row run with no cache, no padding."""
    return model(torch.tensor([seq]))[0, -1]


# ---- decoding state --------------------------------------------------------------------------------

def test_ragged_rows_get_their_own_positions_and_equal_running_alone(model, prompts):
    rows = prompts[:2]                                   # lengths 5 and 9
    st = state(model)
    ids, mask = left_pad(rows, PAD)
    logits = st.prefill(ids, mask)
    assert st.next_pos.tolist() == [5, 9] and st.cache.length == 9 and st.has_holes
    assert st.row_slots(0).tolist() == list(range(4, 9)) and st.row_slots(1).tolist() == list(range(9))
    for r, row in enumerate(rows):
        torch.testing.assert_close(logits[r], alone(model, row), **TOL)
    # A decode step: each row's token goes at its own next position.
    new = logits.argmax(-1)
    logits = st.step(new)
    assert st.next_pos.tolist() == [6, 10] and st.cache.length == 10
    for r, row in enumerate(rows):
        torch.testing.assert_close(logits[r], alone(model, row + [int(new[r])]), **TOL)


def test_dense_rows_keep_no_mask_until_the_first_hole(model, prompts):
    st = state(model)
    ids = torch.tensor([prompts[0], prompts[0][::-1]])
    st.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
    assert st.slot_mask is None and not st.has_holes            # the model's unmasked fast path
    # Row 1 sits this step out (it finished): its slot becomes a hole, earlier slots stay real.
    logits = st.step(torch.tensor([3, 4]), torch.tensor([True, False]))
    assert st.has_holes and st.next_pos.tolist() == [6, 5]
    assert st.row_slots(0).tolist() == list(range(6)) and st.row_slots(1).tolist() == list(range(5))
    logits = st.step(torch.tensor([7, 8]))                       # both rows again
    torch.testing.assert_close(logits[0], alone(model, prompts[0] + [3, 7]), **TOL)
    torch.testing.assert_close(logits[1], alone(model, prompts[0][::-1] + [8]), **TOL)


def test_chunked_feed_equals_one_forward(model, prompts, monkeypatch):
    ids, mask = left_pad(prompts, PAD)                            # 3 rows, 9 columns
    whole = state(model, 3).feed(ids, mask)
    chunked = state(model, 3)
    assert chunked.resolve(GenerateConfig(decode_plan="fixed", decode_q_chunk=4).decode, 9).q_chunk == 4
    widths = []
    real_forward = chunked.backend                                # the forwards go through the state's backend
    monkeypatch.setattr(chunked, "backend", lambda tokens, *a, **kw: widths.append(tokens.shape[1]) or real_forward(tokens, *a, **kw))
    parts = chunked.feed(ids, mask)
    assert widths == [4, 4, 1]
    real = mask[:, :, None].expand_as(whole)                      # padding's logits are unused
    torch.testing.assert_close(parts[real], whole[real], **TOL)


def test_pending_token_goes_in_front_of_the_next_feed(model, prompts):
    st = state(model, 1, slots=8)
    ids = torch.tensor([prompts[0]])
    st.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
    st.pending, st.pending_mask = torch.tensor([11]), torch.tensor([True])
    turn = torch.tensor([[12, 13]])
    tokens, mask = st.with_pending(turn, torch.ones_like(turn, dtype=torch.bool))
    assert tokens.tolist() == [[11, 12, 13]] and mask.all()
    with pytest.raises(CacheOverflowError, match="max_seq_len=8"):
        st.check_room(tokens.shape[1] + 1)                        # 5 + 3 + 1 > 8
    assert st.pending is not None and st.cache.length == 5        # a failed check changes nothing
    logits = st.prefill(tokens, mask)
    assert st.pending is None and st.next_pos.tolist() == [8]
    torch.testing.assert_close(logits[0], alone(model, prompts[0] + [11, 12, 13]), **TOL)


def test_learned_positions_are_checked_with_the_room(tiny):
    gpt2 = tiny(positions="learned", norm="layer", mlp="gelu", max_position_embeddings=8)
    st = state(gpt2, 1, slots=32)
    st.prefill(torch.tensor([[1, 2, 3, 4, 5]]))
    st.check_room(3)
    with pytest.raises(CacheOverflowError, match="n_positions=8"):
        st.check_room(4)


def test_rollback_keeps_each_rows_first_tokens(model, prompts):
    st = state(model)
    a, b = prompts[0][:4], prompts[1][:4]
    st.prefill(torch.tensor([a, b]))
    st.rollback(torch.tensor([2, 3]))                             # row 0 drops 2 tokens, row 1 drops 1
    assert st.cache.length == 3 and st.next_pos.tolist() == [2, 3] and st.has_holes
    assert st.row_slots(0).tolist() == [0, 1] and st.row_slots(1).tolist() == [0, 1, 2]
    logits = st.step(torch.tensor([21, 22]))
    torch.testing.assert_close(logits[0], alone(model, a[:2] + [21]), **TOL)
    torch.testing.assert_close(logits[1], alone(model, b[:3] + [22]), **TOL)
    # Rolling both rows back past the hole leaves a dense cache again.
    st.rollback(torch.tensor([2, 2]))
    assert st.cache.length == 2 and not st.has_holes and st.slot_mask is None
    torch.testing.assert_close(st.step(torch.tensor([5, 6]))[1], alone(model, b[:2] + [6]), **TOL)


def test_rollback_refuses_a_ring(model):
    st = state(model, 1, decode_plan="fixed", decode_local_window=4)
    assert isinstance(st.cache, RingKVCache)
    with pytest.raises(ValueError, match="plain cache"):
        st.rollback(torch.tensor([0]))


def test_reorder_moves_cache_positions_and_mask_with_the_rows(model, prompts):
    st = state(model)
    rows = [prompts[0], prompts[2]]                               # lengths 5 and 2: row 1 is padded
    ids, mask = left_pad(rows, PAD)
    st.prefill(ids, mask)
    st.reorder(torch.tensor([1, 1, 0]))                           # a batch of 3 now
    assert st.batch_size == 3 and st.next_pos.tolist() == [2, 2, 5] and st.slot_mask.shape[0] == 3
    logits = st.step(torch.tensor([30, 31, 32]))
    torch.testing.assert_close(logits[0], alone(model, rows[1] + [30]), **TOL)
    torch.testing.assert_close(logits[1], alone(model, rows[1] + [31]), **TOL)
    torch.testing.assert_close(logits[2], alone(model, rows[0] + [32]), **TOL)


def test_for_config_builds_a_ring_only_where_one_fits(model):
    ring = state(model, 1, decode_plan="fixed", decode_local_window=4, decode_q_chunk=2)
    assert isinstance(ring.cache, RingKVCache) and ring.cache.capacity == 6
    assert ring.resolve(GenerateConfig(decode_plan="fixed", decode_local_window=4, decode_q_chunk=2).decode, 9).ring
    plain = state(model, 1, slots=16, cache_kind="q8_0", residual_len=2, decode_plan="fixed", decode_local_window=4)
    assert not isinstance(plain.cache, RingKVCache) and plain.cache.window == 4 and plain.cache.max_seq_len == 16


# ---- stop checker ----------------------------------------------------------------------------------

class PieceTokenizer:
    """Token i decodes to PIECES[i]: a stop string can span several tokens."""

    PIECES = ["he", "llo", " wo", "rld", "!", "\n", "\n\n", "x"]

    def decode(self, ids) -> str:
        return "".join(self.PIECES[i] for i in ids)


def test_eos_stops_a_row_with_reason_eos():
    stops = StopChecker([7, 9])
    stops.start(3)
    active = stops.update(torch.tensor([9, 1, 7]), torch.tensor([True, True, False]))
    assert active.tolist() == [False, True, False]
    assert stops.reasons == ["eos", "length", "length"]           # an inactive row's token does not count
    assert stops.is_eos(torch.tensor([[7, 8], [9, 1]])).tolist() == [[True, False], [True, False]]
    assert not StopChecker([]).is_eos(torch.tensor([0, 1])).any()


def test_id_stop_sequences_match_across_steps():
    stops = StopChecker([], [[4, 5, 6]])
    stops.start(2)
    active = torch.tensor([True, True])
    for a, b in [(4, 4), (5, 5), (6, 7)]:
        active = stops.update(torch.tensor([a, b]), active)
    assert active.tolist() == [False, True] and stops.reasons == ["stop_sequence", "length"]


def test_string_stops_match_across_token_boundaries():
    stops = StopChecker([], ["lo wor"], PieceTokenizer())
    stops.start(2)
    assert [stops.check(0, t) for t in (0, 1, 2)] == [None, None, None]   # "hello wo"
    assert stops.check(0, 3) == "stop_sequence"                            # "hello world"
    assert stops.check(1, 1) is None and stops.check(1, 3) is None         # "llorld": no " wo"
    assert stops.reasons == ["stop_sequence", "length"]


def test_check_and_update_agree_and_eos_comes_first():
    """The per-token path (speculative) and the per-step path (Generator) give the same reasons."""
    tok = PieceTokenizer()
    seqs = [[0, 1, 5, 6], [7, 5, 7, 5], [0, 4, 2, 3]]
    by_step = StopChecker([4], ["\n\n", [5, 7]], tok)
    by_token = StopChecker([4], ["\n\n", [5, 7]], tok)
    by_step.start(3)
    by_token.start(3)
    active = torch.ones(3, dtype=torch.bool)
    for j in range(4):
        active = by_step.update(torch.tensor([s[j] for s in seqs]), active)
    for r, seq in enumerate(seqs):
        for t in seq:
            if by_token.check(r, t) is not None:
                break
    assert by_step.reasons == by_token.reasons == ["stop_sequence", "stop_sequence", "eos"]
    assert not active.any()


def test_only_the_last_tokens_are_kept():
    stops = StopChecker([], [[1, 2]])
    stops.start(1)
    for t in range(20):
        stops.check(0, 3 + t % 4)
    assert len(stops.recent[0]) == stops.keep == 2 + 8


def test_string_stops_need_a_tokenizer_and_ids_come_from_config():
    with pytest.raises(ValueError, match=r"tokenizer: SpeculativeGenerator\(\.\.\., tokenizer=tok\)"):
        StopChecker([], ["\n"], owner="SpeculativeGenerator")

    class Tok:
        eos_token_id, stop_token_ids = 2, [2, 5, None]

    cfg = GenerateConfig()
    fill_eos_from_tokenizer(cfg, Tok())
    assert cfg.eos_token_id == [2, 5] and pad_id_for(cfg) == 2
    fill_eos_from_tokenizer(cfg := GenerateConfig(eos_token_id=9), Tok())
    assert cfg.eos_ids() == [9]                                    # the config's own ids win
    assert pad_id_for(GenerateConfig(eos_token_id=9, pad_token_id=3)) == 3 and pad_id_for(GenerateConfig()) == 0
    stops = StopChecker.for_config(GenerateConfig(stop_sequences=[[1, 2]]), Tok())
    assert stops.eos_ids == [2, 5] and stops.ids == [[1, 2]]
