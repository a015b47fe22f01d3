"""KV cache quality of many policies in one pass of `caramba eval`'s chunks protocol (llama-perplexity's).

The CLI applies --rotate-keys / --residual-len to every candidate of a run; this script takes one
spec per candidate, so rows with and without rotation share one baseline pass:

    python benchmarks/kv_quality.py --text caramba/data/corpus.txt --ctx 512 \\
        "q4_0" "q4_0 rotate_keys" "q4_1 k=q4_1c" "q2_1 k=q2_1c residual_len=128"

A spec is `KIND [STREAM=KIND ...] [rotate_keys] [rotate_values] [residual_len=N] [qblock=N]
[fp16_prefix_layers=N] [k_qblock=N] [key_order=pairs]` (CachePolicy.build's arguments; k_qblock:
the key stream's own qblock, standard attention only, where CachePolicy.build shares one; and one
experiment).
Prints one JSON object (the records of caramba.evaluation.evaluate.EvalResult) and a markdown table.

`key_order=pairs` is an experiment, not a cache setting: keys are stored in llama.cpp's channel
order, each RoPE pair (i, i + D/2) of HF's half-split layout in adjacent channels (2i, 2i + 1), as
llama.cpp's GGUF converter lays out W_k (a permutation applied to keys and queries through the
layer's key rotation; with rotate_keys the Hadamard matrix is applied after it, which is what
llama.cpp's default q4_0 cache does). Measured worse than HF's layout (docs/kv-cache.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from caramba.cache import CachePolicy
from caramba.cache.kinds import KVCacheTensorConfig
from caramba.cache.policy import ALL_STREAMS
from caramba.evaluation.evaluate import adds_bos, corpus_text, evaluate_chunks
from caramba.model.zoo import load_model


PYDOC_TOPICS = "pydoc-topics"


def pydoc_topics_text(chars: int = 24000) -> str:
    """A second real text that every Python ships (PSF license): the Python reference manual's
    help topics (pydoc_data.topics), joined in sorted key order, first `chars` characters
    (English prose about the language, with grammar rules and code examples)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:chars]


def parse_spec(spec: str) -> tuple[CachePolicy, str | None]:
    """(policy, key order: None or 'pairs')."""
    words = spec.split()
    kind, streams, options, key_order, k_qblock = words[0], {}, {}, None, None
    for w in words[1:]:
        name, _, value = w.partition("=")
        if name in ALL_STREAMS:
            streams[name] = value
        elif name in ("rotate_keys", "rotate_values"):
            options[name] = True
        elif name in ("residual_len", "qblock", "fp16_prefix_layers"):
            options[name] = int(value)
        elif name == "key_order" and value == "pairs":
            key_order = value
        elif name == "k_qblock":
            k_qblock = int(value)
        else:
            raise SystemExit(f"spec {spec!r}: unknown word {w!r}")
    policy = CachePolicy.build(kind, streams or None, **options)
    if k_qblock is not None:   # the standard-attention key stream only (k_sem/k_geo keep the shared one)
        policy = dataclasses.replace(policy, k=KVCacheTensorConfig(policy.k.kind, k_qblock, policy.k.residual_len))
    return policy, key_order


def pair_order(head_dim: int) -> torch.Tensor:
    """[0, D/2, 1, D/2 + 1, ...]: x[..., pair_order(D)] puts RoPE pair (i, i + D/2) at (2i, 2i + 1)."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=1).flatten()


def store_keys_in_pairs(model, key_orders: list[str | None]) -> None:
    """Wrap model.new_cache so that the i-th cache built after the baseline's stores its keys in
    key_orders[i] (evaluate_chunks builds the baseline's cache first, then one per candidate)."""
    build, built = model.new_cache, []

    def new_cache(*args, **kwargs):
        cache = build(*args, **kwargs)
        order = key_orders[len(built) - 1] if built else None
        built.append(cache)
        for layer in cache.layers if order == "pairs" else []:
            if layer.k_stream.quantized and not layer.k_stream.spec.per_channel:
                D = layer.k_stream.head_dim
                perm = torch.eye(D, device=layer.k_stream.codes.device)[:, pair_order(D)]   # x @ perm == x[..., order]
                rot = perm if layer.rotation is None else perm @ layer.rotation
                layer.rotation, layer.unrotation = rot, rot.T.contiguous()
        return cache

    model.new_cache = new_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--text", default=None, help=f"text file (default: caramba's corpus), or {PYDOC_TOPICS} "
                                                 "(pydoc_topics_text())")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--baseline", default="fp32")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "float32", "cpu", progress=False)
    tok = loaded.tokenizer
    bos = tok.bos_token_id if adds_bos(tok) else None
    text = pydoc_topics_text() if args.text == PYDOC_TOPICS else corpus_text(args.text)
    ids = tok.encode(text, add_special_tokens=True)
    parsed = [parse_spec(s) for s in args.specs]
    policies = [p for p, _ in parsed]
    if any(order for _, order in parsed):
        store_keys_in_pairs(loaded.model, [order for _, order in parsed])
    t0 = time.time()
    results = evaluate_chunks(loaded.model, ids, policies, args.baseline, args.ctx, bos)
    record = {"text": args.text or "caramba/data/corpus.txt", "n_tokens": len(ids), "ctx": args.ctx,
              "n_chunks": len(ids) // args.ctx, "bos": bos, "baseline": args.baseline, "specs": args.specs,
              "seconds": round(time.time() - t0, 1),
              "results": [{**r.to_dict(), **({"key_order": order} if order else {})} for r, (_, order) in zip(results, parsed)]}
    print(json.dumps(record))
    r0 = results[0]
    print(f"\n{record['n_chunks']} windows of {args.ctx}, {r0.n_scored} tokens scored; baseline {args.baseline} "
          f"PPL {r0.baseline_ppl:.4f} +/- {r0.baseline_ppl_stderr:.4f}\n")
    print("| cache | bytes/token | PPL | ΔPPL | mean KL | max KL | top-1 agree |\n|---|---|---|---|---|---|---|")
    for r, (_, order) in zip(results, parsed):
        print(f"| {r.policy}{' key_order=pairs' if order else ''} | {r.bytes_per_token} | {r.ppl:.4f} ± {r.ppl_stderr:.4f} | {100 * (r.ppl_ratio - 1):+.2f}% "
              f"| {r.kl_mean:.1e} | {r.kl_max:.2g} | {r.top1_agreement:.4f} |")


if __name__ == "__main__":
    main()
