"""Check the CUDA paths on a tiny random model: every model dtype x cache kind generates on the GPU,
and where the arithmetic is the same as the CPU's (fp32 model, fp32 cache) greedy output is the
CPU's token for token; speculative decoding equals plain greedy on the GPU; beam search runs.

    python benchmarks/cuda_paths.py [cpu]      # prints one line per check, exits 1 on a failure

Not a test (CI has no GPU): run it where a GPU is, and quote its output.
"""

from __future__ import annotations

import sys
import time

import torch

from caramba.cache import kind_names
from caramba.infer import GenerateConfig, Generator, SpeculativeConfig, SpeculativeGenerator, beam_search
from caramba.model.config import ModelConfig
from caramba.model.transformer import Transformer

CONFIG = dict(vocab_size=256, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=256,
              max_position_embeddings=512)
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 9], [11, 12, 13], [200, 1, 2, 3, 4, 5]]


def model_on(device: str, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    return model.to(device=device, dtype=dtype).eval()


def greedy(model, kind: str, n: int = 24) -> list[list[int]]:
    cfg = GenerateConfig(max_new_tokens=n, temperature=0.0, cache_kind=kind, max_seq_len=128)
    return Generator(model, cfg).run(PROMPTS).sequences


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"   # "cpu": the same checks, to try the script
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    if device == "cuda":
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"flash SDPA {torch.backends.cuda.flash_sdp_enabled()}, mem-efficient {torch.backends.cuda.mem_efficient_sdp_enabled()}")
    failures = 0
    reference = greedy(model_on("cpu", torch.float32), "fp32")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        model = model_on(device, dtype)
        for kind in kind_names(aliases=False):
            t0 = time.perf_counter()
            try:
                out = greedy(model, kind)
            except Exception as e:   # report and go on: the point is to see every path
                failures += 1
                print(f"FAIL {str(dtype):15} cache {kind:5}: {type(e).__name__}: {e}")
                continue
            same = sum(a == b for x, y in zip(out, reference) for a, b in zip(x, y)) / sum(len(r) for r in reference)
            exact = dtype == torch.float32 and kind == "fp32"
            ok = same == 1.0 if exact else len(out) == len(PROMPTS)
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {str(dtype):15} cache {kind:5}: {same:6.1%} of tokens as the CPU fp32 run"
                  f"{' (must be 100%)' if exact else ''}, {time.perf_counter() - t0:.2f}s")
    model = model_on(device, torch.float32)
    plain = greedy(model, "fp32")
    # self_int8 runs torch's CPU-only int8 dynamic kernels: refused on a GPU target by design.
    for draft in ("prompt_lookup", "layer_skip") if device == "cuda" else ("prompt_lookup", "self_int8", "layer_skip"):
        cfg = SpeculativeConfig(max_new_tokens=24, temperature=0.0, draft=draft, spec_k=3, max_seq_len=128)
        got = SpeculativeGenerator(model, None, cfg).run(PROMPTS).sequences
        ok = got == plain
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} speculative {draft}: equals plain greedy on the GPU: {ok}")
    res = beam_search(model, PROMPTS, GenerateConfig(max_new_tokens=12, temperature=0.0, num_beams=3, max_seq_len=128))
    print(f"ok   beam search: {len(res.sequences)} rows, best scores {[round(s[0], 3) for s in res.scores]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
