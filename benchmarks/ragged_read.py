"""How a ragged press's cache is read at decode (issue 29): decode steps only, in one process.

    CARAMBA_THREADS=1 .venv/bin/python benchmarks/ragged_read.py [--weights native] [--context 4096]
        [--presses pyramidkv@0.5,ada_snapkv@0.5,ada_snapkv@0.5+dense,snapkv@0.5] [--cache-kind fp32]
        [--rounds 12] [--steps 5]

One task context (niah_single_essay, chat) is prefilled once unpressed and once per press
(caramba.infer.pressing) into fp32 caches; with another `--cache-kind` every cache is then
evicted into that kind (the unpressed one keeping every token: caramba.cache.evict), so the
survivors are stored quantized. Then, round by round in rotated order, each variant decodes
`--steps` greedy tokens from its own state:
- `none`: the unpressed cache on the fused C step (the reference of every ratio);
- `<press>`: the pressed cache on the C step, each head reading only its run of survivors
  (fast_decode passes each row and head's first valid slot); per-head presses store each head's
  survivors packed (caramba.cache.packed);
- `<press>+dense`: the same press with every layer kept at its widest head's width, survivors
  right-aligned behind holes (caramba.cache.evict.PACK = False: the layout before packing);
- `<press>+dense holes` (per-head presses): that cache on the C step with every first valid slot
  forced to 0, so each head reads its layer's whole width as a per-head slot mask would (its
  logits are wrong: only its time counts; the design choice this measures; a packed store has
  no holes to read);
- `<press> torch`: the same cache on the torch path (the C step off: how ragged caches decoded
  before the C step read them).
Per round the median of a variant's steps; the table gives the median over rounds and the median
of each round's ratio to `none`. Prefill times are press_speed.py's business. On a busy machine
the figures are noisy: the CPU and load average are printed.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--presses", default="pyramidkv@0.5,ada_snapkv@0.5,ada_snapkv@0.5+dense,snapkv@0.5")
    ap.add_argument("--cache-kind", default="fp32")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    import caramba  # noqa: F401  (before torch: sets the OpenMP wait policy)
    import torch

    import caramba.cache.evict as evict
    from caramba.evaluation import tasks
    from caramba.infer.pressing import prefill_pressed
    from caramba.infer.state import DecodeState
    from caramba.model import fast_decode
    from caramba.model.backend import TorchStep
    from caramba.model.zoo import load_model
    from caramba.press import PressConfig
    from caramba.runs import capture_env

    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    lm = load_model("smollm2-135m", progress=False, weights=args.weights)
    model = lm.model
    sample = tasks.make_samples("niah_single_essay", args.context, 1, 0, lm.tokenizer, chat=True)[0]
    ids = torch.tensor([sample.context_ids])
    room = args.steps * args.rounds * 4
    env_before = capture_env(None, "cpu")
    torch.set_num_threads(env_before["threads"]["used"])
    template = None if args.cache_kind == "fp32" else model.new_cache(1, 1, args.cache_kind)
    states = {}
    full = DecodeState(model, model.new_cache(1, ids.shape[1] + room, "fp32"))
    states["none"] = [full, full.prefill(ids).argmax(-1)]
    if template is not None:
        kv = model.config.n_kv_heads
        full.press([torch.ones(1, kv, ids.shape[1], dtype=torch.bool)] * model.config.n_layers, template)
    for press in presses:
        state = DecodeState(model, model.new_cache(1, ids.shape[1] + room, "fp32"))
        evict.PACK = not press.endswith("+dense")
        try:
            logits = prefill_pressed(state, ids, None, PressConfig.parse(press.removesuffix("+dense")), template)
        finally:
            evict.PACK = True
        states[press] = [state, logits.argmax(-1)]
        print(f"{press}: {type(state.cache).__name__}, kept {state.kept_share:.3f}", file=sys.stderr, flush=True)
    first_valid = fast_decode._first_valid
    c_step, torch_path = fast_decode.CStep(model), TorchStep(model)   # the two backends a variant decodes with

    def no_holes(layer):
        first = first_valid(layer)
        return first if first is None or first is False else torch.zeros_like(first)

    variants = ([("none", "c", "none")] + [(p, "c", p) for p in presses]
                + [(p, "holes", f"{p} holes") for p in presses if p.startswith("ada_") and p.endswith("+dense")]
                + [(p, "torch", f"{p} torch") for p in presses])
    times: dict[str, list[float]] = {name: [] for _, _, name in variants}
    try:
        for r in range(args.rounds):
            for key, how, name in variants[r % len(variants):] + variants[: r % len(variants)]:
                state, token = states[key]
                state.backend = torch_path if how == "torch" else c_step
                fast_decode._first_valid = no_holes if how == "holes" else first_valid
                layout = state.cache.__dict__.get("_fast_decode_layout")
                if layout is not None:
                    layout.table = None              # rebuilt with this variant's first slots
                steps = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    token = state.step(token).argmax(-1)
                    steps.append(time.perf_counter() - t0)
                states[key][1] = token
                times[name].append(statistics.median(steps))
    finally:
        fast_decode._first_valid = first_valid
    env_after = capture_env(None, "cpu")
    print(f"CPU {env_before['cpu_model']}, {env_before['threads']['used']} thread(s), load average "
          f"{[round(x, 2) for x in env_before['load_average']]} -> {[round(x, 2) for x in env_after['load_average']]}, "
          f"weights {args.weights}, cache {args.cache_kind}, context {ids.shape[1]} tokens, {args.rounds} rounds x {args.steps} steps")
    print("| variant | ms / step | tok/s | speedup vs none | cache MiB |")
    print("|---|---|---|---|---|")
    for key, _, name in variants:
        step = statistics.median(times[name])
        ratio = statistics.median(n / t for n, t in zip(times["none"], times[name]))
        mib = states[key][0].cache.nbytes / 2**20
        print(f"| {name} | {1000 * step:.1f} | {1 / step:.1f} | {ratio:.2f}x | {mib:.1f} |")


if __name__ == "__main__":
    main()
