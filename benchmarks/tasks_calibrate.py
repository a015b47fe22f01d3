"""Calibrate the long-context tasks (caramba.infer.tasks) on the real model: fp32-cache scores.

Each sample is answered as the eval runner answers it: the context prefilled, then the question,
then greedy decoding up to the task's budget or an end-of-reply id; the answer is scored with
`tasks.score`. Prints one line per sample and a table of mean scores per task and length.

    python benchmarks/tasks_calibrate.py --lengths 1024 2048 --n 8 --chat plain chat

A task every cache fails (or passes) tells a researcher nothing: the table shows which settings
leave room both ways on this model.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from caramba.cache import CachePolicy
from caramba.infer.state import DecodeState
from caramba.infer.tasks import DEFAULT_TASKS, make_samples, score
from caramba.model.zoo import load_model


@torch.inference_mode()
def answer(model, tokenizer, sample, stops: set[int]) -> tuple[str, float]:
    slots = len(sample.prompt_ids) + sample.max_new_tokens
    state = DecodeState(model, model.new_cache(1, slots, CachePolicy.of("fp32")), 512)
    t0 = time.perf_counter()
    state.prefill(torch.tensor([sample.context_ids]))
    logits = state.prefill(torch.tensor([sample.question_ids]))
    out: list[int] = []
    while True:
        token = int(logits[0].argmax())
        if token in stops:
            break
        out.append(token)
        if len(out) == sample.max_new_tokens:
            break
        logits = state.step(torch.tensor([token]))
    return tokenizer.decode(out, skip_special_tokens=True), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", nargs="+", choices=("plain", "chat"), default=["chat"])
    ap.add_argument("--json", help="write every answer here")
    args = ap.parse_args()
    loaded = load_model("smollm2-135m", "float32", "cpu", progress=False)
    model, tok = loaded.model, loaded.tokenizer
    stops = set(tok.stop_token_ids)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    rows, table = [], {}
    for mode in args.chat:
        for length in args.lengths:
            for task in args.tasks:
                samples = make_samples(task, length, args.n, args.seed, tok, chat=mode == "chat")
                scores, seconds = [], []
                for s in samples:
                    text, dt = answer(model, tok, s, stops)
                    scores.append(score(text, s.answers, s.metric))
                    seconds.append(dt)
                    rows.append(dict(mode=mode, task=task, length=length, index=s.index, answers=s.answers,
                                     prediction=text, score=scores[-1], seconds=dt, prompt=len(s.prompt_ids)))
                    print(f"{mode} {length} {task} #{s.index}: {scores[-1]:.2f} {dt:.1f}s {text[:100]!r} "
                          f"<- {s.answers}", flush=True)
                table[(mode, task, length)] = (sum(scores) / len(scores), sum(seconds) / len(seconds))
    print("\n| mode | task | " + " | ".join(f"{n} score (s/sample)" for n in args.lengths) + " |")
    print("|---|---|" + "---|" * len(args.lengths))
    for mode in args.chat:
        for task in args.tasks:
            cells = [table[(mode, task, n)] for n in args.lengths]
            print(f"| {mode} | {task} | " + " | ".join(f"{m:.2f} ({t:.1f})" for m, t in cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
