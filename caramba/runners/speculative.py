"""`mode: speculative`: the manifest's prompts through SpeculativeGenerator, with plain decoding
of the same prompts in the same run as the baseline the speedup is measured against."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape

from caramba.errors import UserError
from caramba.infer import Generator
from caramba.infer.config import DraftConfig, flat_names
from caramba.infer.speculative import SpeculativeGenerator
from caramba.manifest import SpeculativeSettings
from caramba.model.zoo import LoadedModel
from caramba.prompting import completion_text, encode_prompt
from caramba.runners.autotune import resolve_cache_auto
from caramba.runners.generate import GenerateMode
from caramba.runners.registry import register
from caramba.runs import RunDir
from caramba.tokenizer import StreamDecoder

# The draft settings a record lists under "config" (DraftConfig's options).
SPEC_FIELDS = tuple(flat_names(DraftConfig))


def run_speculative(loaded: LoadedModel, settings: SpeculativeSettings, seed: int | None, record: RunDir,
                    console: Console, draft: LoadedModel | None = None) -> dict[str, Any]:
    settings, cache_auto = resolve_cache_auto(loaded, settings, record, console)
    tok = loaded.tokenizer
    prompt_ids = [encode_prompt(tok, p, settings.chat, settings.system_prompt) for p in settings.prompts]
    if draft is not None and draft.tokenizer.vocab_size != tok.vocab_size:
        raise UserError(f"draft: the draft model's vocabulary ({draft.tokenizer.vocab_size}) differs from the target's "
                        f"({tok.vocab_size}); speculative decoding needs a draft with the same tokenizer")
    try:
        config = settings.engine_config(seed, list(tok.stop_token_ids) or None)
        spec = SpeculativeGenerator(loaded.model, draft.model if draft else None, config, tokenizer=tok)
    except ValueError as e:
        raise UserError(f"speculative: {str(e).replace('SpeculativeConfig.', '')}") from None
    _warm_up(spec, loaded, prompt_ids[0], settings.baseline)

    results: list[dict[str, Any]] = []
    totals = {"spec_s": 0.0, "plain_s": 0.0, "proposed": 0, "accepted": 0, "forwards": 0, "tokens": 0}
    batches = [range(i, min(i + settings.batch_size, len(prompt_ids))) for i in range(0, len(prompt_ids), settings.batch_size)]
    for b, rows in enumerate(batches):
        batch = [prompt_ids[i] for i in rows]
        spec.config.seed = None if seed is None else seed + b  # as in mode generate: batch b draws from seed + b
        plain, plain_s = None, None
        if settings.baseline:  # plain decoding first, same prompts, same config
            t0 = time.perf_counter()
            plain = Generator(loaded.model, spec.config.generate_config(), tokenizer=tok).run(batch)
            plain_s = time.perf_counter() - t0
        stream = settings.stream and len(rows) == 1
        on_token = None
        if stream:
            console.print(f"[bold]{escape(settings.prompts[rows[0]])}[/bold]", end="\n" if settings.chat else "", highlight=False)
            decoder = StreamDecoder(tok, skip_special_tokens=True)
            on_token = lambda _row, t: console.out(decoder.step(t), end="", highlight=False)  # noqa: E731
        t0 = time.perf_counter()
        out = spec.run(batch, on_token=on_token)
        spec_s = time.perf_counter() - t0
        if stream:
            console.out(decoder.flush(), highlight=False)
        st = out.stats
        for j, i in enumerate(rows):
            text = completion_text(tok, out.sequences[j], settings.stop_sequences)
            if not stream:
                console.print(f"[bold]{escape(settings.prompts[i])}[/bold]{escape(text)}", highlight=False)
            row = {
                "prompt": settings.prompts[i], "prompt_ids": prompt_ids[i], "output_ids": out.sequences[j], "text": text,
                "finish_reason": out.finish_reasons[j], "batch": b, "prefill_s": out.prefill_s, "decode_s": out.decode_s,
                "decode_tok_s": out.decode_tok_s,
                "proposed": st.row_proposed[j], "accepted": st.row_accepted[j], "target_forwards": st.row_forwards[j],
                "acceptance_rate": st.row_accepted[j] / st.row_proposed[j] if st.row_proposed[j] else 0.0,
                "tokens_per_target_forward": st.row_tokens[j] / st.row_forwards[j] if st.row_forwards[j] else 0.0,
                "k_history": st.k_history[j],
                "decode_plan": spec.plan.to_dict(),
            }
            if plain is not None:
                row["plain"] = {"output_ids": plain.sequences[j], "same_as_speculative": plain.sequences[j] == out.sequences[j],
                                "prefill_s": plain.prefill_s, "decode_s": plain.decode_s, "decode_tok_s": plain.decode_tok_s}
            results.append(row)
        totals["spec_s"] += spec_s
        totals["plain_s"] += plain_s or 0.0
        totals["proposed"] += st.proposed
        totals["accepted"] += st.accepted
        totals["forwards"] += sum(st.row_forwards)
        totals["tokens"] += sum(st.row_tokens)
        speedup = f", plain {plain_s:.2f}s -> {plain_s / spec_s:.2f}x" if plain_s else ""
        record.log(f"batch {b}: {len(rows)} prompt(s), {out.n_generated} tokens in {spec_s:.2f}s{speedup}; "
                   f"acceptance {st.acceptance_rate:.3f}, {st.tokens_per_target_forward:.2f} tokens/target forward")
    summary = {
        "n_prompts": len(results),
        "new_tokens": sum(len(r["output_ids"]) for r in results),
        "draft": settings.draft,
        "acceptance_rate": totals["accepted"] / totals["proposed"] if totals["proposed"] else 0.0,
        "tokens_per_target_forward": totals["tokens"] / totals["forwards"] if totals["forwards"] else 0.0,
        "proposed": totals["proposed"], "accepted": totals["accepted"],
        "speculative_s": totals["spec_s"],
        "cache_kind": settings.cache_kind,
        "cache_auto": cache_auto,   # what cache_kind: auto resolved to (None: not auto)
    }
    if settings.baseline:
        summary |= {
            "plain_s": totals["plain_s"],
            "speedup": totals["plain_s"] / totals["spec_s"] if totals["spec_s"] else None,  # wall time, same prompts
            "same_as_plain": all(r["plain"]["same_as_speculative"] for r in results),  # expected True when greedy
        }
    console.print(f"[dim]acceptance {summary['acceptance_rate']:.3f}, {summary['tokens_per_target_forward']:.2f} tokens "
                  f"per target forward" + (f", speedup {summary['speedup']:.2f}x vs plain" if settings.baseline else "") + "[/dim]")
    return {"mode": "speculative", "prompts": results, "summary": summary,
            "config": {name: getattr(settings, name) for name in SPEC_FIELDS}}


def _warm_up(spec: SpeculativeGenerator, loaded: LoadedModel, prompt: list[int], baseline: bool) -> None:
    """One short generation each, so first-call costs land in neither measurement."""
    keep = spec.config.max_new_tokens
    spec.config.max_new_tokens = min(keep, 8)
    try:
        spec.run([prompt])
        if baseline:
            Generator(loaded.model, spec.config.generate_config()).run([prompt])
    finally:
        spec.config.max_new_tokens = keep


class SpeculativeMode(GenerateMode):
    """`mode: speculative`: generate's checks and estimates; no search, no ring buffer."""

    name = "speculative"
    columns = ("speedup", "acceptance_rate", "tokens_per_target_forward", "speculative_s", "plain_s")
    run = staticmethod(run_speculative)

    def searches(self, s: SpeculativeSettings) -> bool:
        return False

    def ring_buffer(self, s: SpeculativeSettings) -> bool:
        return False


register(SpeculativeMode())
