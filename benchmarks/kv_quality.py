"""KV cache quality of many policies in one pass of `caramba eval`'s chunks protocol (llama-perplexity's).

The CLI applies --rotate-keys / --residual-len to every candidate of a run; this script takes one
spec per candidate, so rows with and without rotation share one baseline pass:

    python benchmarks/kv_quality.py --text caramba/data/corpus.txt --ctx 512 \\
        "q4_0" "q4_0 rotate_keys" "q4_1 k=q4_1c" "q2_1 k=q2_1c residual_len=128"

A spec is `KIND [STREAM=KIND ...] [rotate_keys] [residual_len=N] [qblock=N] [fp16_prefix_layers=N]`
(CachePolicy.build's arguments). Prints one JSON object (the records of
caramba.infer.evaluate.EvalResult) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from caramba.cache import CachePolicy
from caramba.cache.policy import ALL_STREAMS
from caramba.infer.evaluate import adds_bos, corpus_text, evaluate_chunks
from caramba.model.zoo import load_model


PYDOC_TOPICS = "pydoc-topics"


def pydoc_topics_text(chars: int = 24000) -> str:
    """A second real text that every Python ships (PSF license): the Python reference manual's
    help topics (pydoc_data.topics), joined in sorted key order, first `chars` characters
    (English prose about the language, with grammar rules and code examples)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:chars]


def parse_spec(spec: str) -> CachePolicy:
    words = spec.split()
    kind, streams, options = words[0], {}, {}
    for w in words[1:]:
        name, _, value = w.partition("=")
        if name in ALL_STREAMS:
            streams[name] = value
        elif name == "rotate_keys":
            options["rotate_keys"] = True
        elif name in ("residual_len", "qblock", "fp16_prefix_layers"):
            options[name] = int(value)
        else:
            raise SystemExit(f"spec {spec!r}: unknown word {w!r}")
    return CachePolicy.build(kind, streams or None, **options)


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
    policies = [parse_spec(s) for s in args.specs]
    t0 = time.time()
    results = evaluate_chunks(loaded.model, ids, policies, args.baseline, args.ctx, bos)
    record = {"text": args.text or "caramba/data/corpus.txt", "n_tokens": len(ids), "ctx": args.ctx,
              "n_chunks": len(ids) // args.ctx, "bos": bos, "baseline": args.baseline, "specs": args.specs,
              "seconds": round(time.time() - t0, 1), "results": [r.to_dict() for r in results]}
    print(json.dumps(record))
    r0 = results[0]
    print(f"\n{record['n_chunks']} windows of {args.ctx}, {r0.n_scored} tokens scored; baseline {args.baseline} "
          f"PPL {r0.baseline_ppl:.4f} +/- {r0.baseline_ppl_stderr:.4f}\n")
    print("| cache | bytes/token | PPL | ΔPPL | mean KL | max KL | top-1 agree |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.policy} | {r.bytes_per_token} | {r.ppl:.4f} ± {r.ppl_stderr:.4f} | {100 * (r.ppl_ratio - 1):+.2f}% "
              f"| {r.kl_mean:.1e} | {r.kl_max:.2g} | {r.top1_agreement:.4f} |")


if __name__ == "__main__":
    main()
