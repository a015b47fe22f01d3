"""`mode: generate`: run a manifest's prompts through the Generator, in batches."""

from __future__ import annotations

import statistics
import time
from typing import Any

from rich.console import Console
from rich.markup import escape

from caramba.errors import UserError
from caramba.infer import GenerateConfig, Generator, beam_search, contrastive_search
from caramba.infer.plan import quiet_window, window_warning
from caramba.manifest import GenerateSettings, ResolvedRun
from caramba.model.backend import ThreadChoice
from caramba.model.zoo import LoadedModel
from caramba.options import options_of
from caramba.press import PressConfig
from caramba.prompting import completion_text, encode_prompt
from caramba.runners.autotune import resolve_cache_auto
from caramba.runners.registry import BASE_RECORD, KIB, Mode, Workload, register
from caramba.runs import RunDir
from caramba.tokenizer import StreamDecoder


def _beam(model, prompt_ids: list[list[int]], config: GenerateConfig) -> list[list[dict[str, Any]]]:
    res = beam_search(model, prompt_ids, config)
    return [[{"output_ids": s, "score": sc, "finish_reason": r} for s, sc, r in zip(seqs, scores, reasons)]
            for seqs, scores, reasons in zip(res.sequences, res.scores, res.finish_reasons)]


def _contrastive(model, prompt_ids: list[list[int]], config: GenerateConfig) -> list[list[dict[str, Any]]]:
    res = contrastive_search(model, prompt_ids, config)
    return [[{"output_ids": s, "score": None, "finish_reason": r}] for s, r in zip(res.sequences, res.finish_reasons)]


# config.search -> the search that runs it, each result as run_search returns it.
SEARCHES = {"beam": _beam, "contrastive": _contrastive}


def run_search(model, prompt_ids: list[list[int]], config: GenerateConfig) -> tuple[list[list[dict[str, Any]]], float]:
    """Beam or contrastive search over prompts -> (per prompt, its returned sequences best first,
    each {"output_ids", "score", "finish_reason"}; elapsed seconds). Contrastive search returns
    one sequence per prompt with score None."""
    t0 = time.perf_counter()
    out = SEARCHES[config.search](model, prompt_ids, config)
    return out, time.perf_counter() - t0


def run_generate(loaded: LoadedModel, settings: GenerateSettings, seed: int | None, record: RunDir, console: Console) -> dict[str, Any]:
    settings, cache_auto = resolve_cache_auto(loaded, settings, record, console)
    tok = loaded.tokenizer
    prompt_ids = [encode_prompt(tok, p, settings.chat, settings.system_prompt) for p in settings.prompts]
    results: list[dict[str, Any]] = []
    if settings.decode_local_window is not None:
        warning = window_warning(settings.decode_local_window)
        console.print(f"[yellow]warning: {escape(warning)}[/yellow]")
        record.log(f"warning: {warning}")
    batches = [range(i, min(i + settings.batch_size, len(prompt_ids))) for i in range(0, len(prompt_ids), settings.batch_size)]
    decode_threads = ThreadChoice()   # the C step's thread choice, carried from batch to batch
    for b, rows in enumerate(batches):
        # Each batch is its own session; with a seed, batch b draws from seed + b so batches differ.
        config = settings.engine_config(None if seed is None else seed + b, list(tok.stop_token_ids) or None)
        if config.search:
            results.extend(_search_batch(loaded, settings, config, rows, prompt_ids, b, record, console))
            continue
        with quiet_window():   # warned above, once
            generator = Generator(loaded.model, config, tokenizer=tok, decode_threads=decode_threads)
        stream = settings.stream and len(rows) == 1
        if stream:
            console.print(f"[bold]{escape(settings.prompts[rows[0]])}[/bold]", end="\n" if settings.chat else "", highlight=False)
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
                console.print(f"[bold]{escape(settings.prompts[i])}[/bold]{escape(text)}", highlight=False)
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
                "decode_plan": generator.plan.to_dict(),
                "decode_step": generator.backend.path,   # the path the steps took (caramba.model.backend)
            })
        record.log(f"batch {b}: {len(rows)} prompt(s), {out.n_generated} tokens, prefill {out.prefill_s:.3f}s, "
                   f"decode {out.decode_s:.3f}s ({out.decode_tok_s:.1f} tok/s), decode plan {generator.plan.to_dict()}")
    rates = [r["decode_tok_s"] for r in results if r["decode_tok_s"]]
    prefills = [r["prefill_s"] for r in results if r["prefill_s"] is not None]   # searches have none
    return {
        "mode": "generate",
        "prompts": results,
        "summary": {
            "n_prompts": len(results),
            "new_tokens": sum(len(r["output_ids"]) for r in results),
            "prefill_s_median": statistics.median(prefills) if prefills else None,
            "decode_tok_s_median": statistics.median(rates) if rates else None,
            "cache_kind": settings.cache_kind,
            "cache_policy": settings.engine_config().cache_spec().to_dict(),
            "cache_auto": cache_auto,   # what cache_kind: auto resolved to (None: not auto)
            "decode_plan": settings.decode_plan,
            "decode_local_window": settings.decode_local_window,
            "exact": all(r.get("decode_plan", {}).get("exact", True) for r in results),  # False: a window changed outputs
        },
    }


def _search_batch(loaded: LoadedModel, settings: GenerateSettings, config: GenerateConfig, rows: range,
                  prompt_ids: list[list[int]], b: int, record: RunDir, console: Console) -> list[dict[str, Any]]:
    """One batch through beam or contrastive search: the best sequence as the prompt's output,
    every returned one (with its score) under "beams"."""
    tok = loaded.tokenizer
    found, elapsed = run_search(loaded.model, [prompt_ids[i] for i in rows], config)
    results = []
    for j, i in enumerate(rows):
        beams = [{**f, "text": completion_text(tok, f["output_ids"], [])} for f in found[j]]
        for rank, beam in enumerate(beams):   # best first; every returned sequence, ranked when there are several
            console.print(f"[bold]{escape(settings.prompts[i])}[/bold]{escape(beam['text'])}", highlight=False)
            if len(beams) > 1:
                score = "" if beam["score"] is None else f" (score {beam['score']:.4f})"
                console.print(f"[dim]#{rank + 1}{score}, {len(beam['output_ids'])} tokens, stop: {beam['finish_reason']}[/dim]")
        results.append({
            "prompt": settings.prompts[i], "prompt_ids": prompt_ids[i], "output_ids": beams[0]["output_ids"],
            "text": beams[0]["text"], "finish_reason": beams[0]["finish_reason"], "score": beams[0]["score"],
            "beams": beams, "strategy": config.search, "batch": b, "search_s": elapsed,
            "prefill_s": None, "decode_s": None, "decode_tok_s": None,
        })
    record.log(f"batch {b}: {len(rows)} prompt(s), {config.search} search, {elapsed:.3f}s")
    return results


class GenerateMode(Mode):
    """`mode: generate` (and, through SpeculativeMode, `mode: speculative`)."""

    name = "generate"
    columns = ("decode_tok_s_median", "prefill_s_median", "new_tokens")
    run = staticmethod(run_generate)

    def searches(self, s: GenerateSettings) -> bool:
        """Beam or contrastive search: every token is cached (prompt + N slots, not N - 1)."""
        return s.num_beams > 1 or s.penalty_alpha is not None

    def ring_buffer(self, s: GenerateSettings) -> bool:
        """A sliding window decodes through a ring buffer: not bounded by max_seq_len."""
        return not self.searches(s) and s.decode_local_window is not None

    def preflight(self, r: ResolvedRun, where: str, sources) -> None:
        s = r.run.settings
        if s.batch_size > len(s.prompts):
            raise UserError(f"{where}: {self.section}.batch_size={s.batch_size} is more than its {len(s.prompts)} "
                            f"prompt(s); a batch holds at most every prompt: set batch_size to {len(s.prompts)} or less")
        if not self.ring_buffer(s):
            check_prompts_fit(s, self.section, self.searches(s), sources.prompt_lengths(r.model.source, s), where)
        press = PressConfig(**{o.attr: getattr(s, o.name) for o in options_of(PressConfig)})
        if press.enabled:
            check_pressable(press, sources.config(r.model.source), f"{where}: {self.section}.press")
            lengths = sources.prompt_lengths(r.model.source, s)
            short = min(lengths)
            if short < press.min_context():
                raise UserError(f"{where}: {self.section}.press={press.method}: prompt {lengths.index(short) + 1} has "
                                f"{short} tokens; the press scores contexts of at least {press.min_context()} (its "
                                "window or sinks plus one): use longer prompts or a smaller press_window / press_sinks")

    def record_bytes(self, r: ResolvedRun) -> int:
        s = r.run.settings   # ~64 bytes a generated token (id, text, timing) and the prompts
        rows = len(s.prompts) * max(1, getattr(s, "num_return_sequences", 1))
        return BASE_RECORD + sum(4 * len(p) for p in s.prompts) + rows * (1 * KIB + 64 * s.max_new_tokens)

    def workload(self, r: ResolvedRun) -> Workload:
        s = r.run.settings
        contrastive = (s.top_k or 1) if s.penalty_alpha is not None else 1   # top_k candidates a step
        return Workload(s.max_seq_len, s.batch_size * max(s.num_beams, contrastive), f"{self.section}.batch_size",
                        f"{self.section}.max_seq_len", max_seq_len=s.max_seq_len)


def check_pressable(press: PressConfig, config, where: str) -> None:
    """A press on a decoupled (DBA) model: refused before anything runs."""
    if config.attention == "decoupled":
        raise UserError(f"{where}: presses score standard attention's keys; this decoupled (DBA) model's three "
                        f"streams have none yet: drop {press.method} or use a standard-attention model")


def check_prompts_fit(s: GenerateSettings, section: str, search: bool, lengths: list[int], where: str) -> None:
    """Each batch's widest prompt plus max_new_tokens must fit the cache (max_seq_len), by the
    engine's own rule: sampling/greedy and speculative decoding cache every token but the last
    (prompt + N - 1 slots), beam and contrastive search all of them (prompt + N)."""
    for start in range(0, len(lengths), s.batch_size):
        batch = lengths[start : start + s.batch_size]
        width = max(batch)   # prompts of a batch are left-padded to its widest
        need = width + s.max_new_tokens - (0 if search else 1)
        if need > s.max_seq_len:
            i = start + batch.index(width)
            raise UserError(
                f"{where}: {section}.max_new_tokens={s.max_new_tokens} after prompt {i + 1} ({width} tokens) needs "
                f"{need} cache positions, more than {section}.max_seq_len={s.max_seq_len}; raise max_seq_len to "
                f"{need} or lower max_new_tokens to {s.max_new_tokens - (need - s.max_seq_len)}"
                if s.max_new_tokens > need - s.max_seq_len else
                f"{where}: prompt {i + 1} of {section}.prompts is {width} tokens, too long for "
                f"{section}.max_seq_len={s.max_seq_len} with max_new_tokens={s.max_new_tokens}; raise max_seq_len "
                f"to {need} or shorten the prompt")


register(GenerateMode())
