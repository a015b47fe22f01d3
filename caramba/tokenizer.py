"""Text <-> token ids, on HF's Rust `tokenizers`, built from a GGUF's metadata or an HF directory.

    tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    stream = StreamDecoder(tok)
    for i in generated_ids:
        print(stream.step(i), end="")

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and special ids
as `tokenizer.ggml.*` metadata, and names the pre-tokenizer (how text is cut before BPE) in
`tokenizer.ggml.pre`. We rebuild the tokenizer that name stands for in llama.cpp. For `smollm`
that splits every digit on its own before the GPT-2 regex, as SmolLM2's own tokenizer.json does;
transformers' GGUF loader (5.x) drops the digit split, so it differs from the model's tokenizer
when a run of spaces precedes a digit ("x  1"). SentencePiece vocabularies (`tokenizer.ggml.model =
llama`: Gemma, Llama 2) are built in caramba.tokenizer_sentencepiece.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from caramba.chat_template import compile_template, render
from caramba.errors import UserError
from caramba.tokenizer_sentencepiece import sentencepiece_tokenizer

# llama.cpp token types (gguf.TokenType): control tokens are special (<|im_end|>), user-defined
# ones are added but not special (<think>); both must be matched whole in text, never cut by BPE.
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer regexes, from the models' own tokenizer.json files (llama.cpp uses the same).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` names, grouped by the pre-tokenizer llama.cpp gives them.
_GPT2_PRE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell"}
_SPLIT_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_NFC_PRE = {"qwen2", "deepseek-r1-qwen"}  # Qwen2's tokenizer.json normalizes to NFC first


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: special ids and the chat template.

    Special tokens (BOS/EOS) are added by the backend's post-processor, so `encode` adds BOS only
    where the model's files say to (SmolLM2: never; its chat template writes <|im_start|> itself).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        stop_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        source: str = "<memory>",
        json_sha256: str | None = None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self.source = source
        self.json_sha256 = json_sha256   # of the tokenizer.json it was read from (content_key)
        # Every id that ends a reply: EOS plus e.g. Llama 3's <|eot_id|> (GGUF eot/eom, generation_config lists).
        eos = [eos_token_id] if eos_token_id is not None else []
        self.stop_token_ids = tuple(dict.fromkeys([*eos, *stop_token_ids]))
        self._template = None   # compiled on first use (caramba.chat_template)

    @property
    def content_key(self) -> tuple | None:
        """What its encodings and chat renderings are a function of, as a hashable key: equal for
        two tokenizers read from the same files (a preflight's and the loaded model's), so what
        one produced can stand for the other's (caramba.evaluation.tasks' memo). None where it
        was built in memory (a GGUF's, a test's): no key short of serializing the whole backend
        (~20 ms for SmolLM2's). Nothing changes a backend after loading it."""
        if self.json_sha256 is None:
            return None
        key = (self.json_sha256, self.chat_template, self.bos_token_id, self.eos_token_id, self._pad_token_id,
               self.unk_token_id, self.stop_token_ids)
        try:
            hash(key)
        except TypeError:   # a config's odd value (a list among the stop ids): no key rather than an error
            return None
        return key

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, *, reader=None) -> Tokenizer:
        """Build the tokenizer a GGUF file describes. Pass `reader` (a `gguf.GGUFReader` already
        open on this file) to skip parsing the file again, which takes seconds."""
        path = Path(path)
        if reader is None:
            reader = _open_gguf(path)
        meta = _GGUFMeta(reader, path)
        kind = meta.get("tokenizer.ggml.model", str)
        if kind is None:
            raise UserError(f"{path}: GGUF has no tokenizer (metadata 'tokenizer.ggml.model' is missing)")
        if kind not in ("gpt2", "llama"):
            raise UserError(f"{path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) "
                            "and 'llama' (SentencePiece) are supported yet")
        tokens, token_types = _vocabulary(meta)
        merges = _merges(meta)

        def token_id(key: str) -> int | None:
            value = meta.get(key, int)
            if value is not None and not 0 <= value < len(tokens):
                raise UserError(f"{path}: '{key}' = {value} is outside the vocabulary (0..{len(tokens) - 1})")
            return value

        bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
        pad, unk = token_id("tokenizer.ggml.padding_token_id"), token_id("tokenizer.ggml.unknown_token_id")
        if kind == "gpt2":
            backend = _byte_level_bpe(meta, tokens, token_types, merges)
        else:
            backend = sentencepiece_tokenizer(meta, tokens, token_types, merges, [bos, eos, unk, pad])
        # A SentencePiece file without the flag gets BOS, as in llama.cpp and transformers.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", bool)
        add_bos = (kind == "llama" and bos is not None) if add_bos is None else add_bos
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", bool))
        if (add_bos and bos is None) or (add_eos and eos is None):
            raise UserError(f"{path}: metadata asks to add BOS/EOS to every text but gives no bos/eos token id")
        prefix, suffix = ([bos] if add_bos else []), ([eos] if add_eos else [])
        if prefix or suffix:
            backend.post_processor = processors.TemplateProcessing(
                single=[tokens[i] for i in prefix] + ["$A"] + [tokens[i] for i in suffix],
                special_tokens=[(tokens[i], i) for i in {*prefix, *suffix}],
            )

        stops = [token_id(f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
            unk_token_id=unk,
            stop_token_ids=[i for i in stops if i is not None],
            chat_template=meta.get("tokenizer.chat_template", str),
            source=str(path),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """A bare tokenizer.json: no special token ids or chat template (use `from_dir` for those)."""
        backend, digest = _load_tokenizer_json(Path(path))
        return cls(backend, source=str(path), json_sha256=digest)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """An HF model directory: tokenizer.json, plus tokenizer_config.json (special tokens, chat
        template), chat_template.jinja and generation_config.json (stop ids) where present."""
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"{path}: not a directory (expected an HF model directory with tokenizer.json)")
        backend, digest = _load_tokenizer_json(path / "tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):  # a serialized AddedToken
                token = token.get("content")
            if token is None:
                return None
            found = backend.token_to_id(token)
            if found is None:
                raise UserError(f"{path / 'tokenizer_config.json'}: {name} {token!r} is not in the vocabulary")
            return found

        stops = generation.get("eos_token_id")
        stops = [stops] if isinstance(stops, int) else list(stops or [])
        eos = token_id("eos_token")
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=eos if eos is not None else (stops[0] if stops else None),
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            stop_token_ids=stops,
            chat_template=_chat_template_in_dir(path, config),
            source=str(path),
            json_sha256=digest,
        )

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (and generation_config.json when there are
        stop ids besides EOS) so that `from_dir`, or transformers' AutoTokenizer, loads it back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token(self.bos_token_id),
            "eos_token": self._token(self.eos_token_id),
            "pad_token": self._token(self._pad_token_id),
            "unk_token": self._token(self.unk_token_id),
            "chat_template": self.chat_template,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        if len(self.stop_token_ids) > 1:
            generation = {"eos_token_id": list(self.stop_token_ids)}
            (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    # ---- encoding and decoding -----------------------------------------------------------------

    @property
    def pad_token_id(self) -> int | None:
        """The pad id, or EOS when the model names none (padding is masked out anyway)."""
        return self._pad_token_id if self._pad_token_id is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, return_tensors: str | None = None):
        """Token ids for `text`. Special token strings in it (<|im_start|>) become their single ids.
        return_tensors="pt": a [1, T] tensor, as HF tokenizers give it."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return _as_tensors(ids, return_tensors)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def __call__(self, texts: str | Sequence[str], return_tensors: str | None = None, padding: bool = False,
                 add_special_tokens: bool = True) -> dict:
        """HF's call form: {"input_ids", "attention_mask"}. With padding, rows are LEFT-padded with the
        pad id (what generation needs: every row's next token comes last); pass the attention_mask
        to Generator.generate so padding is not read as text."""
        rows = self.encode_batch([texts] if isinstance(texts, str) else texts, add_special_tokens)
        if padding:
            width = max(len(r) for r in rows)
            masks = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
            rows = [[self.pad_token_id or 0] * (width - len(r)) + r for r in rows]
        else:
            masks = [[1] * len(r) for r in rows]
        if isinstance(texts, str) and return_tensors is None:
            rows, masks = rows[0], masks[0]
        return {"input_ids": _as_tensors(rows, return_tensors, batch=True),
                "attention_mask": _as_tensors(masks, return_tensors, batch=True)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """ids: a list or a 1-D tensor."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, rows, skip_special_tokens: bool = False) -> list[str]:
        """A text per row of a [B, T] tensor or a list of id lists."""
        return [self.decode(row, skip_special_tokens) for row in rows]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation to the prompt text the model was tuned on, as transformers does.

        `messages` are {"role": ..., "content": ...} dicts; extra keyword arguments (tools=...)
        reach the template as variables. Encode the result with add_special_tokens=False when the
        template writes BOS itself.
        """
        if self.chat_template is None:
            raise UserError(
                f"the tokenizer from {self.source} has no chat template; give a plain prompt instead of messages"
            )
        if self._template is None:
            self._template = compile_template(self.chat_template, self.source)
        variables = {
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._token(self.bos_token_id),
            "eos_token": self._token(self.eos_token_id),
            "pad_token": self._token(self._pad_token_id),
            "unk_token": self._token(self.unk_token_id),
            **kwargs,
        }
        return render(self._template, variables, self.source)


class StreamDecoder:
    """Text for token ids fed one at a time, emitted as soon as it is printable.

    A character can span several byte-level tokens (an emoji is 4 bytes); while it is incomplete the
    decoded text ends in U+FFFD and we hold it back. Text is decoded from one token before the last
    emitted one, so decoders that strip a leading space (SentencePiece) see the same context both times.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the window we decode
        self._read = 0    # end of what has been emitted

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is still partial)."""
        self.ids.append(token_id)
        done, text = self._window()
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (a cut-off character comes out as U+FFFD)."""
        done, text = self._window()
        self._prefix = self._read = len(self.ids)
        return text[len(done):]

    def _window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        window = self.ids[self._prefix:]
        done = decode(window[: self._read - self._prefix], self.skip_special_tokens)
        return done, decode(window, self.skip_special_tokens)


# ---- helpers -----------------------------------------------------------------------------------


def _open_gguf(path: Path):
    from caramba.model import gguf_loader   # lazy: torch and gguf load only when a GGUF is read (one parse per process)

    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        return gguf_loader.open_gguf(path)
    except ValueError as e:
        raise UserError(str(e)) from None


class _GGUFMeta:
    """Typed access to a GGUF reader's metadata, with errors that name the file and the key."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, kind: type):
        field = self.reader.fields.get(key)
        if field is None:
            return None
        value = field.contents()
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UserError(f"{self.path}: metadata '{key}' should be {kind.__name__}, found {value!r:.80}")
        return value

    def require(self, key: str, kind: type):
        value = self.get(key, kind)
        if value is None:
            raise UserError(f"{self.path}: GGUF metadata lacks '{key}'")
        return value


def _vocabulary(meta: _GGUFMeta) -> tuple[list[str], list[int]]:
    """The token strings and their llama.cpp types (empty when the file gives none)."""
    path = meta.path
    tokens = meta.require("tokenizer.ggml.tokens", list)
    token_types = meta.get("tokenizer.ggml.token_type", list) or []
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise UserError(f"{path}: 'tokenizer.ggml.tokens' must be a non-empty list of strings")
    if token_types and len(token_types) != len(tokens):
        raise UserError(f"{path}: 'tokenizer.ggml.token_type' has {len(token_types)} entries for {len(tokens)} tokens")
    return tokens, token_types


def _merges(meta: _GGUFMeta) -> list[tuple[str, str]] | None:
    """The file's BPE merges as pairs, or None: SentencePiece files have none (they are derived)."""
    merges = meta.get("tokenizer.ggml.merges", list)
    if merges is None:
        return None
    pairs = []
    for merge in merges:
        pair = merge.split(" ") if isinstance(merge, str) else []
        if len(pair) != 2:
            raise UserError(f"{meta.path}: malformed entry in 'tokenizer.ggml.merges': {merge!r} (want 'left right')")
        pairs.append((pair[0], pair[1]))
    return pairs


def _byte_level_bpe(meta: _GGUFMeta, tokens: list[str], token_types: list[int],
                    merges: list[tuple[str, str]] | None) -> tokenizers.Tokenizer:
    """The BPE model, pre-tokenizer and added tokens a byte-level GGUF (`gpt2`) describes."""
    if merges is None:
        raise UserError(f"{meta.path}: GGUF metadata lacks 'tokenizer.ggml.merges'")
    # The file's strings are already in the byte-level alphabet, so they go to BPE as they are.
    backend = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    backend.normalizer, backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", str) or "default", meta.path)
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED])
    return backend


def _pre_tokenizer(name: str, path: Path):
    """(normalizer, pre-tokenizer) for a `tokenizer.ggml.pre` name, as llama.cpp reads it."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2_PRE:
        return None, gpt2
    if name in _DIGITS_THEN_GPT2_PRE:
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if name in _SPLIT_PRE:
        split = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        return (normalizers.NFC() if name in _NFC_PRE else None), split
    known = sorted(_GPT2_PRE | _DIGITS_THEN_GPT2_PRE | set(_SPLIT_PRE))
    raise UserError(
        f"{path}: pre-tokenizer 'tokenizer.ggml.pre' = {name!r} is not supported (known: {', '.join(known)})"
    )


def _load_tokenizer_json(path: Path) -> tuple[tokenizers.Tokenizer, str]:
    """The backend and the sha256 of the bytes it was built from (read once: ~2 ms for SmolLM2's 3.5 MB)."""
    if not path.is_file():
        raise UserError(f"{path}: no such file (a tokenizer.json is needed)")
    try:
        raw = path.read_bytes()
        return tokenizers.Tokenizer.from_str(raw.decode("utf-8")), hashlib.sha256(raw).hexdigest()
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise UserError(f"{path}: not a valid tokenizer.json ({e})") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _chat_template_in_dir(path: Path, config: dict) -> str | None:
    # Newer transformers save the template as its own file; older ones inside tokenizer_config.json,
    # sometimes as a list of named templates of which "default" is the chat one.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template


def _as_tensors(ids, return_tensors: str | None, batch: bool = False):
    if return_tensors is None:
        return ids
    if return_tensors != "pt":
        raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' (torch) is supported")
    import torch

    return torch.tensor(ids if batch else [ids], dtype=torch.long)
