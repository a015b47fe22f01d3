"""How much a DBA conversion of SmolLM2 costs, over a grid of (sem_dim, geo_dim): mean NLL of
one full forward (no cache) over the corpus's first --tokens tokens, for the source model and
each conversion, with and without calibration (whitened vs weight-space SVD).

    flock /tmp/caramba-heavy.lock .venv/bin/python benchmarks/dba_convert.py 32,32 16,32 8,32 16,48 8,48

Calibration uses the corpus from token 2048 on (caramba.model.dba_convert.CALIBRATION_START),
disjoint from the scored tokens. The cache-based numbers are `caramba eval --model DIR`
(docs/kv-cache.md).
"""

from __future__ import annotations

import argparse
import json

import torch

from caramba.evaluation.evaluate import corpus_ids
from caramba.model.dba_convert import CALIBRATION_START, convert_state, input_moments
from caramba.model.zoo import build_model, load_model


@torch.inference_mode()
def mean_nll(model, ids: torch.Tensor) -> float:
    logp = torch.log_softmax(model(ids)[0, :-1].float(), dim=-1)
    return float(-logp.gather(-1, ids[0, 1:, None]).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("settings", nargs="+", help="sem,geo pairs (per head), e.g. 16,32")
    ap.add_argument("--tokens", type=int, default=1024, help="scored tokens from the corpus start")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--no-weight-svd", action="store_true", help="skip the uncalibrated (weight-space) rows")
    args = ap.parse_args()
    loaded = load_model("smollm2-135m", progress=False)
    model, all_ids = loaded.model, corpus_ids(loaded.tokenizer)
    ids = torch.tensor([all_ids[: args.tokens]])
    calib = all_ids[CALIBRATION_START:][: args.calib_tokens]
    moments = input_moments(model, torch.tensor([calib]))
    state = model.state_dict()
    rows = [{"model": "source", "nll": mean_nll(model, ids)}]
    print(json.dumps(rows[-1]), flush=True)
    for spec in args.settings:
        sem, geo = map(int, spec.split(","))
        for name, m in [("whitened", moments)] + ([] if args.no_weight_svd else [("weight-space", None)]):
            conv = convert_state(model.config, state, sem, geo, m)
            dba = build_model(conv.config, conv.state, torch.float32, torch.device("cpu"))
            rows.append({"model": f"sem={sem},geo={geo}", "svd": name, **conv.summary(), "nll": mean_nll(dba, ids)})
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["nll"]
    print(f"\n| conversion | SVD | energy kept | NLL | PPL | dNLL |\n|---|---|---|---|---|---|\n"
          f"| source | | | {base:.4f} | {torch.tensor(base).exp():.2f} | |")
    for r in rows[1:]:
        print(f"| {r['model']} | {r['svd']} | {r['sem_svd_energy_kept']:.3f} | {r['nll']:.4f} | "
              f"{torch.tensor(r['nll']).exp():.2f} | {r['nll'] - base:+.4f} |")


if __name__ == "__main__":
    main()
