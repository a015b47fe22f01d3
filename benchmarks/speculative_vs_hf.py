"""Speculative decoding on SmolLM2-135M (CPU, fp32, batch 1, greedy): caramba vs HF transformers.

Two tasks: input-grounded (the model is asked to reproduce a given piece of code with one
change, so much of the answer is in the prompt) and open (a story, nothing to copy). For each,
end-to-end wall time of the answer (up to N new tokens; it stops at the model's end-of-reply
token, since after it the text is no longer grounded; --ignore-eos makes exactly N):

  caramba: plain decoding, then speculative with prompt_lookup, self_int8 and layer_skip drafts
  HF:      plain generate, prompt_lookup_num_tokens, and assistant_model = an int8 dynamically
           quantized copy of the same model (the same self-draft as caramba's self_int8)

Speedups are against the same library's plain decoding, measured in the same process with the
methods alternating after a warm-up; medians of --repeats. caramba's greedy outputs are checked
equal to its plain output.

    flock /tmp/caramba-heavy.lock .venv/bin/python benchmarks/speculative_vs_hf.py [--new-tokens 128] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from caramba.infer import GenerateConfig, Generator  # noqa: E402
from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator  # noqa: E402
from caramba.model.zoo import load_model, resolve_source  # noqa: E402

CODE = '''def parse_config(path):
    """Read a key=value config file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            result[key.strip()] = value.strip()
    return result'''

PARAGRAPH = ("The lighthouse stood at the edge of the cliff for more than two hundred years. Every night its "
             "keeper climbed the narow stairs, trimmed the wick and polished the great lens, so that ships "
             "pasing in the dark could find their way around the rocks. When the light was finally automated, "
             "the keeper stayed on in the cottage below, writing down the weather in a notebook every morning.")

TASKS = {
    "input_grounded": f"Rename the function parse_config to read_config and return the complete code.\n\n```python\n{CODE}\n```",
    "input_grounded_text": f"Fix the two spelling mistakes in this paragraph and return the whole corrected paragraph.\n\n{PARAGRAPH}",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def chat_ids(tok, text: str) -> list[int]:
    from caramba.prompting import encode_prompt

    return encode_prompt(tok, text, chat=True)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec-k", type=int, default=4, help="caramba's starting k (adaptive, HF heuristic)")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: " + ", ".join(TASKS))
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --new-tokens tokens")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2-135m", "float32", "cpu", progress=False)
    model, tok = loaded.model, loaded.tokenizer
    path = resolve_source("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(hf), {torch.nn.Linear}, dtype=torch.qint8).eval()
    # The same draft-length rule as caramba's runs: HF's heuristic from the same start.
    hf_int8.generation_config.num_assistant_tokens = args.spec_k
    hf_int8.generation_config.num_assistant_tokens_schedule = "heuristic"
    n = args.new_tokens
    eos = None if args.ignore_eos else list(tok.stop_token_ids)

    def caramba_plain(ids):
        return Generator(model, GenerateConfig(max_new_tokens=n, temperature=0.0, eos_token_id=eos)).run([ids]).sequences[0], None

    spec_gens = {
        kind: SpeculativeGenerator(model, None, SpeculativeConfig(
            max_new_tokens=n, temperature=0.0, eos_token_id=eos, draft=kind, spec_k=args.spec_k, spec_k_adaptive=True, spec_k_max=16))
        for kind in ("prompt_lookup", "self_int8", "layer_skip")
    }

    def caramba_spec(kind):
        def go(ids):
            gen = spec_gens[kind]
            res = gen.run([ids])
            return res.sequences[0], res.stats
        return go

    def hf_run(**kw):
        def go(ids):
            x = torch.tensor([ids])
            with torch.inference_mode():
                stop = {"min_new_tokens": n, "eos_token_id": None} if eos is None else {"eos_token_id": eos}
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0, **stop, **kw)
            return out[0, len(ids):].tolist(), None
        return go

    methods = {
        "caramba_plain": caramba_plain,
        "caramba_prompt_lookup": caramba_spec("prompt_lookup"),
        "caramba_self_int8": caramba_spec("self_int8"),
        "caramba_layer_skip": caramba_spec("layer_skip"),
        "hf_plain": hf_run(),
        "hf_prompt_lookup": hf_run(prompt_lookup_num_tokens=args.lookup_tokens),
        "hf_assistant_int8": hf_run(assistant_model=hf_int8),
    }
    results = {}
    for task in args.tasks.split(","):
        text = TASKS[task]
        ids = chat_ids(tok, text)
        if not results:  # warm-up, once
            for fn in methods.values():
                fn(ids)
        times = {name: [] for name in methods}
        outputs, stats = {}, {}
        for _ in range(args.repeats):  # alternate so drift on a shared machine hits every method alike
            for name, fn in methods.items():
                t, (out, st) = timed(lambda: fn(ids))
                times[name].append(t)
                outputs[name] = out
                if st is not None:
                    stats[name] = st
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rows = {}
        for name in methods:
            lib = name.split("_")[0]
            row = {"s_median": med[name], "new_tokens": len(outputs[name]), "tok_s": len(outputs[name]) / med[name],
                   "speedup_vs_own_plain": med[f"{lib}_plain"] / med[name],
                   "samples_s": times[name]}
            if name in stats:
                st = stats[name]
                row |= {"acceptance_rate": st.acceptance_rate, "tokens_per_target_forward": st.tokens_per_target_forward,
                        "k_mean": statistics.mean(k for k in st.k_history[0] if k) if any(st.k_history[0]) else 0.0,
                        "same_as_plain": outputs[name] == outputs["caramba_plain"]}
            if name.startswith("hf_") and name != "hf_plain":
                row["same_as_plain"] = outputs[name] == outputs["hf_plain"]
            rows[name] = row
        results[task] = {"prompt_tokens": len(ids), "methods": rows,
                         "output_preview": tok.decode(outputs["caramba_plain"])[:200]}
        print(f"\n{task} ({len(ids)} prompt tokens, {len(outputs['caramba_plain'])} new):")
        print(f"  {'method':24s} {'tok/s':>7s} {'speedup':>8s} {'accept':>7s} {'tok/fwd':>8s} same")
        for name, row in rows.items():
            acc = f"{row['acceptance_rate']:.2f}" if "acceptance_rate" in row else "-"
            tpf = f"{row['tokens_per_target_forward']:.2f}" if "tokens_per_target_forward" in row else "-"
            print(f"  {name:24s} {row['tok_s']:7.1f} {row['speedup_vs_own_plain']:7.2f}x {acc:>7s} {tpf:>8s} {row.get('same_as_plain', '')}")
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
           "loadavg_1m_5m_15m": os.getloadavg()}
    print(f"\nthreads {env['threads']}, load average {env['loadavg_1m_5m_15m']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": vars(args), "env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
