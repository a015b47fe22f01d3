"""SentencePiece vocabularies (`tokenizer.ggml.model = llama`: Gemma, Llama 2, Mistral...) as a HF
`tokenizers.Tokenizer`, built the way transformers' GGUF loader builds them, so ids match
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`.

The file holds tokens, a score per token and token types, no merges. Like transformers we run it
as a BPE with byte fallback (`<0x41>` tokens for characters not in the vocabulary) whose merges are
every way to cut a token into two tokens, best first: by score, except for Gemma, whose scores do
not follow its merge order; there the order of the tokens in the file does. Text reaches BPE with
its spaces spelled `▁`, with or without one in front (`tokenizer.ggml.add_space_prefix`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from caramba.errors import UserError

if TYPE_CHECKING:
    from caramba.tokenizer import _GGUFMeta

SPACE = "\u2581"  # "▁": how SentencePiece spells a space inside tokens
# llama.cpp token types (gguf.TokenType), as in caramba.tokenizer.
_CONTROL, _USER_DEFINED = 3, 4
# `general.architecture` values whose tokenizers transformers builds differently from Llama's.
_GEMMA_ARCHS = {"gemma", "gemma2", "gemma3"}
_PHI3_ARCHS = {"phi3"}


def sentencepiece_tokenizer(
    meta: _GGUFMeta, tokens: list[str], token_types: list[int], merges: list[tuple[str, str]] | None,
    named: list[int | None],
) -> tokenizers.Tokenizer:
    """The tokenizer a SentencePiece GGUF describes. `merges`: the file's, if it has any (else
    derived). `named`: the ids of BOS, EOS, UNK and PAD (None where absent), added as special
    tokens as transformers does even when the file does not type them control."""
    path = meta.path
    arch = meta.get("general.architecture", str) or ""
    style = "gemma" if arch in _GEMMA_ARCHS else "phi3" if arch in _PHI3_ARCHS else "llama"
    scores = meta.get("tokenizer.ggml.scores", list)
    if scores is None:
        raise UserError(
            f"{path}: tokenizer.ggml.model is 'llama' (SentencePiece) but 'tokenizer.ggml.scores' is missing; "
            "only 'gpt2' (byte-level BPE) vocabularies come without scores"
        )
    if len(scores) != len(tokens) or not all(isinstance(s, (int, float)) for s in scores):
        raise UserError(f"{path}: 'tokenizer.ggml.scores' must hold one number per token ({len(tokens)})")

    if style == "gemma":
        # Gemma stores its tokens of 2+ spaces with real spaces ("  "), which the normalized text
        # never contains; transformers respells them "▁▁", so they are reached by merges.
        spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: -i for i, t in enumerate(spelled)}  # file order, not the scores
    else:
        spelled, rank = tokens, dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(spelled)}  # a repeated token keeps its last id, as in HF
    if merges is None:
        merges = _merges_from_vocab(vocab, rank)
    # transformers gives a Llama-style BPE no unknown token; we do, so that a character with
    # neither a piece nor <0xNN> tokens (never in a real byte-fallback vocabulary) is not dropped.
    unk = named[2]
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True,
    ))

    # Here we follow the file, as llama.cpp does, not transformers: it ignores the flag (a prefix
    # space always for Llama-style files, never for Gemma's). Without the flag: its defaults.
    prefix = meta.get("tokenizer.ggml.add_space_prefix", bool)
    prefix = style != "gemma" if prefix is None else prefix
    if style == "phi3":  # a prefix space after every special token too, as transformers builds Phi-3
        steps = [normalizers.Prepend(SPACE)] if prefix else []
        backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    else:
        if style == "gemma":
            backend.normalizer = normalizers.Replace(" ", SPACE)
        if prefix or style == "llama":  # "first": only at the very start of the text, not after <s>
            backend.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
            )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))

    typed = list(zip(tokens, token_types))
    control = dict.fromkeys([t for t, k in typed if k == _CONTROL] + [tokens[i] for i in named if i is not None])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # A user-defined token is matched whole (Gemma's "\n\n", "<b>"), unless respelled above
    # (transformers adds only those still in the vocabulary under their file spelling).
    user = [t for t, k in typed if k == _USER_DEFINED and t in vocab and t not in control]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend


def _merges_from_vocab(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens that joins into a token, as transformers'
    `generate_merges` orders them: by the joined token's rank, then longer left, then longer right
    pieces first, ties in file order. One sort instead of its per-token ones gives the same list
    (two cuts of one token never tie) in about half its time on Gemma's 262k tokens."""
    found = []
    for token, score in rank.items():  # first spelling's place, last spelling's rank, as HF's dicts
        n = len(token)
        for i in range(n - 1, 0, -1):  # longer left pieces first: Gemma's list comes out sorted
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                found.append((-score, -i, i - n, len(found), left, right))
    found.sort()  # len(found) makes every key unique: ties keep file order, strings are never compared
    return [(left, right) for *_, left, right in found]
