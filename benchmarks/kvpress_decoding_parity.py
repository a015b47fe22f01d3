"""Decoding-time compression against NVIDIA's kvpress DecodingPress, on the same SmolLM2 weights.

Runs in the kvpress benchmark environment (benchmarks/kvpress_parity.py says how it is built), with
this checkout first on the path:

    PYTHONPATH=. /work/venvs/kvpress/bin/python benchmarks/kvpress_decoding_parity.py \\
        [--context 1024] [--new-tokens 200] [--interval 64] [--target 512] [--methods knorm,keydiff] [--out FILE]

One chat-formatted task context (niah_single_essay) is prefilled unpressed and --new-tokens tokens
are generated greedily, compressing every --interval decode steps to --target tokens per head:
kvpress with DecodingPress(base_press=METHOD, compression_interval, target_size) hooked on HF's
model (the loop feeds explicit positions, as kvpress's pipeline does, since the pressed cache is
shorter than the positions), caramba with `press=METHOD, press_ratio=0, press_interval,
press_target` through its Generator. Compared: the greedy tokens (how many of the first N agree
before the first difference), and the survivors: per layer and KV head, the cached keys' norms,
sorted (kvpress gathers survivors in score order, caramba keeps slot order) and paired within
fp32 noise (relative 1e-4): the share of kvpress's survivors that caramba kept too.

Methods: knorm and keydiff score the keys alone and do not depend on the cache's slot order, so
both libraries implement the same thing. streaming_llm is not compared: kvpress's gather leaves
the survivors in topk order, so after its first compression "the first n_sink slots" are no longer
the first tokens. snapkv, tova and expected_attention differ by design (docs/kv-cache.md#decoding-
time-compression: kvpress re-rotates its buffered hidden states at the current position).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402


@torch.inference_mode()
def kvpress_run(hf, method: str, ids: list[int], args) -> tuple[list[int], list[list[torch.Tensor]]]:
    """kvpress's greedy tokens and, per layer, each KV head's surviving keys' sorted norms."""
    import kvpress
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    base = {"knorm": kvpress.KnormPress, "keydiff": kvpress.KeyDiffPress}[method]()
    press = kvpress.DecodingPress(base_press=base, compression_interval=args.interval, target_size=args.target)
    cache = DynamicCache()
    out = []
    with press(hf):
        logits = hf(input_ids=torch.tensor([ids]), past_key_values=cache).logits
        pos = len(ids)
        for step in range(args.new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if step == args.new_tokens - 1:
                break
            logits = hf(input_ids=torch.tensor([[token]]), past_key_values=cache,
                        position_ids=torch.tensor([[pos]])).logits
            pos += 1
    norms = []
    for i in range(len(cache.layers)):
        keys, _ = extract_keys_and_values(cache, i)
        norms.append([k.norm(dim=-1).sort().values for k in keys[0].float()])
    return out, norms


@torch.inference_mode()
def caramba_run(model, method: str, ids: list[int], args) -> tuple[list[int], list[list[torch.Tensor]], int]:
    from caramba.infer import GenerateConfig, Generator

    config = GenerateConfig(max_new_tokens=args.new_tokens, temperature=0.0, eos_token_id=None, press=method,
                            press_ratio=0.0, press_interval=args.interval, press_target=args.target,
                            max_seq_len=len(ids) + args.new_tokens)
    gen = Generator(model, config)
    out = gen.generate(torch.tensor([ids]))[0, len(ids):].tolist()
    L = gen.cache.length
    norms = [[k.norm(dim=-1).sort().values for k in layer.contents(L)[0][0].float()] for layer in gen.cache.layers]
    return out, norms, gen.decoding.compressions


def matched(a: list[float], b: list[float], rtol: float = 1e-4) -> int:
    """How many of two sorted lists' values pair up within rtol (a merge: one token kept by one
    side only does not shift the rest)."""
    i = j = n = 0
    while i < len(a) and j < len(b):
        if abs(a[i] - b[j]) <= rtol * max(abs(a[i]), abs(b[j])):
            n, i, j = n + 1, i + 1, j + 1
        elif a[i] < b[j]:
            i += 1
        else:
            j += 1
    return n


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--target", type=int, default=512)
    ap.add_argument("--methods", default="knorm,keydiff")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM

    from caramba.evaluation.tasks import make_samples
    from caramba.model.zoo import load_model, resolve_source
    from caramba.runs import cpu_model

    transformers.logging.disable_progress_bar()
    loaded = load_model("smollm2-135m", "float32", "cpu", progress=False)
    path = resolve_source("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    ids = make_samples("niah_single_essay", args.context, 1, 0, loaded.tokenizer, chat=True)[0].context_ids
    rows = []
    for method in args.methods.split(","):
        theirs, their_norms = kvpress_run(hf, method, ids, args)
        ours, our_norms, compressions = caramba_run(loaded.model, method, ids, args)
        same = total = 0
        for t_layer, o_layer in zip(their_norms, our_norms):
            for t, o in zip(t_layer, o_layer):
                total += len(t)
                same += matched(t.tolist(), o.tolist())
        rows.append(dict(method=method, tokens=len(ours), leading_tokens_equal=agreement(theirs, ours),
                         identical=theirs == ours, compressions=compressions,
                         cache_len_kvpress=len(their_norms[0][0]), cache_len_caramba=len(our_norms[0][0]),
                         survivor_norms_equal=same / total))
        print(json.dumps(rows[-1]), flush=True)
    result = dict(context_tokens=len(ids), new_tokens=args.new_tokens, interval=args.interval, target=args.target,
                  versions=dict(kvpress=version("kvpress"), transformers=transformers.__version__,
                                torch=torch.__version__, python=platform.python_version()),
                  cpu=cpu_model(), load_average=os.getloadavg(), rows=rows)
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
