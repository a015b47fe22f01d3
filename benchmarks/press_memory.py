"""What a press's cache allocates (issue 29: "a press must free memory for real"), per cache kind.

    .venv/bin/python benchmarks/press_memory.py [--weights native] [--context 4096]
        [--press ada_snapkv@0.5] [--kinds fp32,q8_0,q4_0,q4_1/k=q4_1c] [--room 32]
        [--time-steps 0] [--threads 1]

One task context (niah_single_essay, chat) is prefilled once while the press watches; its kept
masks are computed once, then the context is evicted into each kind (KIND/POLICY: a cache policy,
e.g. q4_1/k=q4_1c for KIVI's per-channel keys) with per-head ragged layers packed (caramba.cache.
packed) and kept dense at each layer's widest head (caramba.cache.evict's pack=False, the layout
before packing). Per kind: the unpressed cache of the context plus the room, both pressed caches,
and what the survivors need (each layer, row and KV head's kept tokens plus the room at the kind's
bytes per token; residual windows and per-channel rings, fixed per head, are in the measured
figures only). The memory figures do not depend on the machine's load.

With --time-steps N the two pressed caches of each kind then decode N greedy steps each on the
fused C step (CStep, --threads pinned), alternating step by step (packed, dense, dense, packed,
...) so both see the same load: the median step of each and the median of the step pairs' ratios.
Both read the same survivors; only where they lie differs. On a busy machine the times are noisy:
the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="native")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--press", default="ada_snapkv@0.5")
    ap.add_argument("--kinds", default="fp32,q8_0,q4_0,q4_1/k=q4_1c")
    ap.add_argument("--room", type=int, default=32)
    ap.add_argument("--time-steps", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    room = max(args.room, args.time_steps + 1)

    import torch

    from caramba.cache import CachePolicy
    from caramba.cache.evict import evict, kept_counts
    from caramba.evaluation import tasks
    from caramba.infer.state import DecodeState
    from caramba.model.backend import TorchStep
    from caramba.model.fast_decode import CStep, ThreadChoice
    from caramba.model.zoo import load_model
    from caramba.press import PressConfig, kept_masks, observing

    lm = load_model("smollm2-135m", progress=False, weights=args.weights)
    model, press = lm.model, PressConfig.parse(args.press)
    ids = torch.tensor([tasks.make_samples("niah_single_essay", args.context, 1, 0, lm.tokenizer, chat=True)[0]
                        .context_ids])
    S = ids.shape[1]
    state = DecodeState(model, model.new_cache(1, S, "fp32"))
    with torch.inference_mode(), observing(model, state.cache, press) as seen, state.using(TorchStep(model)):
        first = state.prefill(ids).argmax(-1)
    kept = kept_masks(state.cache, seen, press, state.valid_slots())
    counts = kept_counts(kept)                                           # [L, B, KVH]
    D = model.config.head_dim
    print(f"{args.press} on a {S}-token context, room {room}: kept {int(counts.sum())} of "
          f"{S * counts.numel()} (layer, head) tokens")
    step = CStep(model, ThreadChoice(fixed=args.threads)) if args.time_steps else None
    timed = []
    print("| cache kind | unpressed MiB | pressed, dense (widest head) MiB | pressed, packed MiB | "
          "survivors + room MiB |")
    print("|---|---|---|---|---|")
    for spec in args.kinds.split(","):
        kind, _, policy = spec.partition("/")
        pol = CachePolicy.build(kind, policy or None)
        template = model.new_cache(1, 1, pol)
        full = model.new_cache(1, S + room, pol).nbytes
        caches = {pack: evict(state.cache, kept, template, room=room, pack=pack) for pack in (True, False)}
        dense, packed = caches[False][0].nbytes, caches[True][0].nbytes
        per_token = pol.k.bytes_per_token(1, D) + pol.v.bytes_per_token(1, D)
        need = int((counts + room).sum()) * per_token
        print(f"| {spec} | {full / 2**20:.1f} | {dense / 2**20:.1f} | {packed / 2**20:.1f} | {need / 2**20:.1f} |")
        if step is not None:
            timed.append((spec, alternate(model, state, caches, step, first, args.time_steps)))
    if timed:
        print(f"C step, {args.threads} thread(s), {args.time_steps} steps each alternating, load average "
              f"{[round(x, 2) for x in os.getloadavg()]} (after)")
        print("| cache kind | packed ms / step | dense ms / step | dense / packed (median of pairs) |")
        print("|---|---|---|---|")
        for spec, (a, b, ratio) in timed:
            print(f"| {spec} | {1000 * a:.2f} | {1000 * b:.2f} | {ratio:.3f} |")


def alternate(model, source, caches: dict, step, first, n: int) -> tuple[float, float, float]:
    """(median packed step, median dense step, median of the pairs' dense / packed) over n steps
    each, alternating, from the same next token."""
    import torch

    from caramba.infer.state import DecodeState

    states, tokens = {}, {}
    for pack, (cache, slot_mask) in caches.items():
        st = DecodeState(model, cache, backend=step)
        st.next_pos, st.slot_mask = source.next_pos.clone(), slot_mask
        states[pack], tokens[pack] = st, first
    times = {True: [], False: []}
    with torch.inference_mode():
        for i in range(n):
            for pack in ((True, False) if i % 2 == 0 else (False, True)):
                t0 = time.perf_counter()
                tokens[pack] = states[pack].step(tokens[pack]).argmax(-1)
                times[pack].append(time.perf_counter() - t0)
    assert step.path == "c", step.path
    ratios = [b / a for a, b in zip(times[True], times[False])]
    return statistics.median(times[True]), statistics.median(times[False]), statistics.median(ratios)


if __name__ == "__main__":
    main()
