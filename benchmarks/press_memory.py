"""What a press's cache allocates (issue 29: "a press must free memory for real"), per cache kind.

    .venv/bin/python benchmarks/press_memory.py [--weights native] [--context 4096]
        [--press ada_snapkv@0.5] [--kinds fp32,q8_0,q4_0,q4_1/k=q4_1c] [--room 32]

One task context (niah_single_essay, chat) is prefilled once while the press watches; its kept
masks are computed once, then the context is evicted into each kind (KIND/POLICY: a cache policy,
e.g. q4_1/k=q4_1c for KIVI's per-channel keys) with per-head ragged layers packed (caramba.cache.
packed) and kept dense at each layer's widest head (caramba.cache.evict's pack=False, the layout
before packing). Per kind: the unpressed cache of the context plus the room, both pressed caches,
and what the survivors need (each layer, row and KV head's kept tokens plus the room at the kind's
bytes per token; residual windows and per-channel rings, fixed per head, are in the measured
figures only). Memory only, no timing: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import sys
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
    args = ap.parse_args()

    import torch

    from caramba.cache import CachePolicy
    from caramba.cache.evict import evict, kept_counts
    from caramba.infer import tasks
    from caramba.infer.state import DecodeState
    from caramba.model.backend import TorchStep
    from caramba.model.zoo import load_model
    from caramba.press import PressConfig, kept_masks, observing

    lm = load_model("smollm2-135m", progress=False, weights=args.weights)
    model, press = lm.model, PressConfig.parse(args.press)
    ids = torch.tensor([tasks.make_samples("niah_single_essay", args.context, 1, 0, lm.tokenizer, chat=True)[0]
                        .context_ids])
    S = ids.shape[1]
    state = DecodeState(model, model.new_cache(1, S, "fp32"))
    with torch.inference_mode(), observing(model, state.cache, press) as seen, state.using(TorchStep(model)):
        state.prefill(ids)
    kept = kept_masks(state.cache, seen, press, state.valid_slots())
    counts = kept_counts(kept)                                           # [L, B, KVH]
    D = model.config.head_dim
    print(f"{args.press} on a {S}-token context, room {args.room}: kept {int(counts.sum())} of "
          f"{S * counts.numel()} (layer, head) tokens")
    print("| cache kind | unpressed MiB | pressed, dense (widest head) MiB | pressed, packed MiB | "
          "survivors + room MiB |")
    print("|---|---|---|---|---|")
    for spec in args.kinds.split(","):
        kind, _, policy = spec.partition("/")
        pol = CachePolicy.build(kind, policy or None)
        template = model.new_cache(1, 1, pol)
        full = model.new_cache(1, S + args.room, pol).nbytes
        dense = evict(state.cache, kept, template, room=args.room, pack=False)[0].nbytes
        packed = evict(state.cache, kept, template, room=args.room, pack=True)[0].nbytes
        per_token = pol.k.bytes_per_token(1, D) + pol.v.bytes_per_token(1, D)
        need = int((counts + args.room).sum()) * per_token
        print(f"| {spec} | {full / 2**20:.1f} | {dense / 2**20:.1f} | {packed / 2**20:.1f} | {need / 2**20:.1f} |")


if __name__ == "__main__":
    main()
