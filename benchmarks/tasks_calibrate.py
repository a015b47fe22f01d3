"""Calibrate the long-context tasks (caramba.evaluation.tasks) on the real model: fp32-cache scores.

Each sample is answered as the eval runner answers it: the context prefilled, then the question,
then greedy decoding up to the task's budget or an end-of-reply id; the answer is scored with
`tasks.score`. Prints one line per sample and a table of mean scores per task and length.

    python benchmarks/tasks_calibrate.py --lengths 1024 2048 --n 8 --chat plain chat
    python benchmarks/tasks_calibrate.py --tasks vt0 --variant vt0=vt:examples=0,num_hops=2

--variant NAME=TASK:field=value,... tries other settings of a task (TaskSpec fields) under a new
name, without editing the module.

A task every cache fails (or passes) tells a researcher nothing: the table shows which settings
leave room both ways on this model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import torch

from caramba.cache import CachePolicy
from caramba.infer.state import DecodeState
from caramba.evaluation import tasks
from caramba.evaluation.tasks import DEFAULT_TASKS, make_samples, score
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


def add_variant(text: str) -> None:
    name, rest = text.split("=", 1)
    base, _, fields = rest.partition(":")
    spec = tasks.TASKS[base]
    changes = {}
    for item in filter(None, fields.split(",")):
        key, value = item.split("=", 1)
        kind = type(getattr(spec, key))
        changes[key] = kind(value)
    tasks.TASKS[name] = dataclasses.replace(spec, name=name, **changes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--start", type=int, default=0, help="answer samples start..n-1 (add to an earlier run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", nargs="+", choices=("plain", "chat"), default=["chat"])
    ap.add_argument("--json", help="write every answer here")
    ap.add_argument("--variant", action="append", default=[], help="NAME=TASK:field=value,... (see the doc)")
    args = ap.parse_args()
    for v in args.variant:
        add_variant(v)
    loaded = load_model("smollm2-135m", "float32", "cpu", progress=False)
    model, tok = loaded.model, loaded.tokenizer
    stops = set(tok.stop_token_ids)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    rows, cells = [], {}
    for mode in args.chat:
        for length in args.lengths:
            samples = {t: make_samples(t, length, args.n, args.seed, tok, chat=mode == "chat") for t in args.tasks}
            for i in range(args.start, args.n):   # sample i of every task, then i + 1: a cut-short run covers every task
                for task in args.tasks:
                    s = samples[task][i]
                    text, dt = answer(model, tok, s, stops)
                    got = score(text, s.answers, s.metric)
                    cells.setdefault((mode, task, length), []).append((got, dt))
                    rows.append(dict(mode=mode, task=task, length=length, index=s.index, answers=s.answers,
                                     prediction=text, score=got, seconds=dt, prompt=len(s.prompt_ids)))
                    print(f"{mode} {length} {task} #{s.index}: {got:.2f} {dt:.1f}s {text[:100]!r} "
                          f"<- {s.answers}", flush=True)
    table = {k: (sum(g for g, _ in v) / len(v), sum(d for _, d in v) / len(v)) for k, v in cells.items()}
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
