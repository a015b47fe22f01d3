"""`mode: generate`: run a manifest's prompts through the Generator, in batches."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console

from caramba.infer import GenerateConfig, Generator
from caramba.manifest import GenerateSettings
from caramba.model.zoo import LoadedModel
from caramba.prompting import completion_text, encode_prompt
from caramba.runs import RunDir
from caramba.tokenizer import StreamDecoder


def generate_config(settings: GenerateSettings, seed: int | None, eos_token_id: int | list[int] | None) -> GenerateConfig:
    return GenerateConfig(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        repetition_penalty=settings.repetition_penalty,
        eos_token_id=eos_token_id,
        stop_sequences=list(settings.stop_sequences),
        max_seq_len=settings.max_seq_len,
        seed=seed,
        cache_kind=settings.cache_kind,
    )


def run_generate(loaded: LoadedModel, settings: GenerateSettings, seed: int | None, record: RunDir, console: Console) -> dict[str, Any]:
    tok = loaded.tokenizer
    prompt_ids = [encode_prompt(tok, p, settings.chat, settings.system_prompt) for p in settings.prompts]
    results: list[dict[str, Any]] = []
    batches = [range(i, min(i + settings.batch_size, len(prompt_ids))) for i in range(0, len(prompt_ids), settings.batch_size)]
    for b, rows in enumerate(batches):
        # Each batch is its own session; with a seed, batch b draws from seed + b so batches differ.
        config = generate_config(settings, None if seed is None else seed + b, list(tok.stop_token_ids) or None)
        generator = Generator(loaded.model, config, tokenizer=tok)
        stream = settings.stream and len(rows) == 1
        if stream:
            console.print(f"[bold]{settings.prompts[rows[0]]}[/bold]", end="\n" if settings.chat else "", highlight=False)
            decoder = StreamDecoder(tok, skip_special_tokens=True)
            on_token = lambda _row, t: console.out(decoder.step(t), end="", highlight=False)  # noqa: E731
        else:
            on_token = None
        out = generator.run([prompt_ids[i] for i in rows], on_token=on_token)
        if stream:
            console.out(decoder.flush(), highlight=False)
        for j, i in enumerate(rows):
            text = completion_text(tok, out.sequences[j], settings.stop_sequences)
            if not stream:
                console.print(f"[bold]{settings.prompts[i]}[/bold]{text}", highlight=False)
            results.append({
                "prompt": settings.prompts[i],
                "prompt_ids": prompt_ids[i],
                "output_ids": out.sequences[j],
                "text": text,
                "finish_reason": out.finish_reasons[j],
                "batch": b,
                "prefill_s": out.prefill_s,
                "decode_s": out.decode_s,
                "decode_tok_s": out.decode_tok_s,
            })
        record.log(f"batch {b}: {len(rows)} prompt(s), {out.n_generated} tokens, prefill {out.prefill_s:.3f}s, "
                   f"decode {out.decode_s:.3f}s ({out.decode_tok_s:.1f} tok/s)")
    rates = [r["decode_tok_s"] for r in results if r["decode_tok_s"] > 0]
    return {
        "mode": "generate",
        "prompts": results,
        "summary": {
            "n_prompts": len(results),
            "new_tokens": sum(len(r["output_ids"]) for r in results),
            "prefill_s_median": statistics.median(r["prefill_s"] for r in results),
            "decode_tok_s_median": statistics.median(rates) if rates else None,
            "cache_kind": settings.cache_kind,
        },
    }
