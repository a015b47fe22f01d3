"""Issue 46: a left-padded row of a batch answers as the same prompt alone, pressed or not, whatever
the cache kind -- built for real: a tiny random model, a batch of prompts of different lengths
against each prompt alone, greedy on the torch path and with the fused C step.

Per-channel (KIVI) keys quantize groups of G tokens along the slots. They used to start every row's
groups at the batch's slot 0, so a row behind p pad slots (or, after a press, holes) grouped its
tokens p mod G slots off from the row alone and its first group mixed in padding. Now each row's
groups start at its first real slot (ChannelQuantStream.set_origins: DecodeState.feed sets it from
the padding, caramba.cache.evict from a press's holes, each row at its widest head's first
survivor, as alone). A packed layer (caramba.cache.packed) and the fused C step (kv_stream.c)
start groups at multiples of G only: a pressed layer whose rows need other origins stays dense,
and the C step leaves a stream with per-row origins to the torch path."""

from __future__ import annotations

import pytest
import torch

from caramba.cache import CachePolicy
from caramba.infer.padding import left_pad
from caramba.infer.pressing import prefill_pressed
from caramba.infer.state import DecodeState
from caramba.press import PressConfig
from conftest import make_model
from test_evict import decode

LONG, SHORT, STEPS = 40, 27, 16
KINDS = {"q4_1": CachePolicy.build("q4_1", qblock=8),                    # per token
         "k=q4_1c,v=q4_1": CachePolicy.build("q4_1", "k=q4_1c", qblock=8)}  # KIVI: keys per channel, groups of 8
PRESSES = {"none": None, "snapkv": PressConfig(method="snapkv", ratio=0.5, window_size=8),
           "knorm": PressConfig(method="knorm", ratio=0.5)}


@pytest.fixture(scope="module")
def model():
    m = make_model(seed=5, n_layers=3, n_heads=4, n_kv_heads=2)
    m.fast_decode = False
    return m


def answers(model, rows: list[list[int]], policy: CachePolicy, press: PressConfig | None) -> list[list[int]]:
    """Greedy tokens of each left-padded row: the first from the (pressed) prefill, then STEPS more."""
    tokens, mask = left_pad(rows, 0)
    state = DecodeState(model, model.new_cache(len(rows), tokens.shape[1] + STEPS, policy))
    with torch.inference_mode():
        logits = state.prefill(tokens, mask) if press is None else prefill_pressed(state, tokens, mask, press)
        first = logits.argmax(-1)
        _, more = decode(state, first, STEPS)
    return torch.cat([first[:, None], more], dim=1).tolist()


def prompts(model, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (LONG + SHORT,), generator=g).tolist()
    return ids[:LONG], ids[LONG:]


@pytest.mark.parametrize("press", list(PRESSES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_padded_row_answers_as_the_prompt_alone(model, kind, press):
    for seed in (0, 1):
        long, short = prompts(model, seed)
        batch = answers(model, [long, short], KINDS[kind], PRESSES[press])
        assert batch[1] == answers(model, [short], KINDS[kind], PRESSES[press])[0], f"seed {seed}: the padded row"
        assert batch[0] == answers(model, [long], KINDS[kind], PRESSES[press])[0], f"seed {seed}: the long row"


@pytest.mark.parametrize("press", list(PRESSES))
def test_per_channel_keys_answer_alone_when_the_offsets_are_whole_groups(model, press):
    """The control that names the cause: 48 and 32 tokens, so the short row sits behind 16 = 2 G pad
    slots and, pressed by half, behind 24 - 16 = G holes. Its groups are then its own alone (plus
    groups of pure padding or holes) and it answers as the prompt alone."""
    g = torch.Generator().manual_seed(0)
    long, short = (torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (48, 32))
    batch = answers(model, [long, short], KINDS["k=q4_1c,v=q4_1"], PRESSES[press])
    assert batch[1] == answers(model, [short], KINDS["k=q4_1c,v=q4_1"], PRESSES[press])[0]


MORE_KINDS = {"k=q4_1c,v=q4_1 qblock=16 residual_len=5": CachePolicy.build("q4_1", "k=q4_1c", qblock=16, residual_len=5),
              "k=q2_1c,v=q4_1 residual_len=3": CachePolicy.build("q4_1", "k=q2_1c", qblock=8, residual_len=3)}
MORE_PRESSES = {"none": None, "ada_snapkv": PressConfig(method="snapkv", ratio=0.5, window_size=8, adaptive=True),
                "pyramidkv": PressConfig(method="pyramidkv", ratio=0.5, window_size=8)}


@pytest.mark.parametrize("fast", [False, True], ids=["torch", "c_step"])
@pytest.mark.parametrize("press", list(MORE_PRESSES))
@pytest.mark.parametrize("kind", list(MORE_KINDS))
def test_per_channel_rows_of_three_lengths_answer_alone(kind, press, fast):
    """Three rows (two padded by other than whole groups), per-head and per-layer budgets, a residual
    window, 2-bit keys, groups of 16 (the C attention kernel's), on the torch path and with the C
    step chosen (which takes the rows alone and leaves the padded batch's per-channel steps to torch)."""
    model = make_model(seed=5, n_layers=3, n_heads=4, n_kv_heads=2)
    model.fast_decode = fast
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (45, 20, 33)]
    batch = answers(model, rows, MORE_KINDS[kind], MORE_PRESSES[press])
    for i, row in enumerate(rows):
        assert batch[i] == answers(model, [row], MORE_KINDS[kind], MORE_PRESSES[press])[0], f"row {i}"


@pytest.mark.parametrize("back", [5, 15])
def test_a_padded_per_channel_row_rolls_back_as_alone(model, back):
    """A rollback (speculative decoding's) of every row by `back` tokens: 15 goes back into a group
    the ring no longer holds, which each row refills from its own groups' codes."""
    policy = KINDS["k=q4_1c,v=q4_1"]

    def run(rows):
        tokens, mask = left_pad(rows, 0)
        state = DecodeState(model, model.new_cache(len(rows), tokens.shape[1] + 30, policy))
        with torch.inference_mode():
            _, ahead = decode(state, state.prefill(tokens, mask).argmax(-1), 20)
            state.rollback(state.next_pos - back)
            refills = any(layer.k_stream.refills(layer.length) for layer in state.cache.layers)
            return decode(state, ahead[:, 19 - back], 10)[1].tolist(), refills

    long, short = prompts(model, 3)
    batch, refills = run([long, short])
    assert refills == (back == 15)
    assert batch[1] == run([short])[0][0] and batch[0] == run([long])[0][0]
