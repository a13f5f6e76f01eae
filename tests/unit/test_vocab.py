"""Tokenizers rebuilt from GGUF metadata (engines/formats/vocab.py) against transformers' own
GGUF tokenizer: the real SmolLM2 file (byte-level BPE) and a small SentencePiece-style
file written here."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from engines.config import ModelError
from engines.formats.vocab import tokenizer_from_gguf
from tests.unit.gguf_files import gguf_meta

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SPACE = "\u2581"

SAME_AS_TRANSFORMERS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve Ærøskøbing",
    "你好，世界。日本語のテキスト",
    "🙂👍🏽 family: 👨\u200d👩\u200d👧",
    "a  b   c\t\t d\n\n\ne   ",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "it's I'M you'll WE'VE",
    "",
    " ",
]







# --- SmolLM2: byte-level BPE, pre-tokenizer "smollm" -------------------------------------

@pytest.mark.parametrize("text", SAME_AS_TRANSFORMERS)
def test_smollm_encodes_and_decodes_as_transformers(smollm, smollm_ref, text):
    ids = smollm.encode(text)
    assert ids == list(smollm_ref(text)["input_ids"])
    assert smollm.decode(ids) == smollm_ref.decode(ids, skip_special_tokens=True)


def test_smollm_splits_every_digit_as_the_model_does(smollm, smollm_ref):
    # SmolLM2's tokenizer.json and llama.cpp ("smollm") split digits one by one before the
    # GPT-2 regex; transformers' GGUF loader uses the plain GPT-2 regex. Its vocabulary has
    # no multi-digit tokens, so plain digit runs agree, but whitespace before a digit does
    # not: the GPT-2 regex leaves the last space to join the digit, we keep the run whole.
    assert smollm.encode("12345 and 2026") == list(smollm_ref("12345 and 2026")["input_ids"])
    for text in ("3.14159", "x=1234567890", "a1b22c333"):
        tokens = [smollm.id_to_token(i) for i in smollm.encode(text)]
        assert [t for t in tokens if t.isdigit()] == [c for c in text if c.isdigit()]
    double_space = smollm.token_to_id("\u0120\u0120")  # "ĠĠ": two spaces, byte-level
    assert smollm.encode("x  2026") == [smollm.token_to_id("x"), double_space] + [
        smollm.token_to_id(d) for d in "2026"]
    assert smollm_ref("x  2026")["input_ids"][:3] == [smollm.token_to_id("x")] + [
        smollm.token_to_id("\u0120")] * 2
    assert smollm.decode(smollm.encode("x  2026\n\n12")) == "x  2026\n\n12"


def test_smollm_special_tokens(smollm, smollm_meta):
    assert smollm.token_to_id("<|im_end|>") == smollm_meta["tokenizer.ggml.eos_token_id"] == 2
    assert smollm.id_to_token(1) == "<|im_start|>"
    assert smollm.id_to_token(10**6) is None and smollm.id_to_token(-1) is None
    assert smollm.id_to_token(2**40) is None and smollm.token_to_id("no such token") is None
    # add_bos_token is false in the file: encode adds nothing, with or without specials.
    assert smollm.encode("hi") == smollm.encode("hi", add_special_tokens=False) == [6004]
    assert smollm.decode([1, 6004, 2]) == "hi"


def test_smollm_tokenizer_builds_fast(smollm_meta):
    start = time.perf_counter()
    tokenizer_from_gguf(smollm_meta)
    # About 0.1 s here; the bound only catches an accidental quadratic step.
    assert time.perf_counter() - start < 2.0


# --- pre-tokenizer families --------------------------------------------------------------

def byte_alphabet_meta(pre: str | None) -> dict:
    from tokenizers import pre_tokenizers
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": [],
            "tokenizer.ggml.tokens": sorted(pre_tokenizers.ByteLevel.alphabet())}
    return meta if pre is None else meta | {"tokenizer.ggml.pre": pre}


@pytest.mark.parametrize("pre,pieces", [
    # GPT-2's contractions are lower case only; Llama 3's and Qwen2's ignore case.
    (None, ["12345", "Ġabc", "'", "S"]),
    ("gpt2", ["12345", "Ġabc", "'", "S"]),
    ("smollm", ["1", "2", "3", "4", "5", "Ġabc", "'", "S"]),
    ("llama-bpe", ["123", "45", "Ġabc", "'S"]),
    ("qwen2", ["1", "2", "3", "4", "5", "Ġabc", "'S"]),
])
def test_pre_tokenizer_families(pre, pieces):
    inner = tokenizer_from_gguf(byte_alphabet_meta(pre)).inner
    assert [p for p, _ in inner.pre_tokenizer.pre_tokenize_str("12345 abc'S")] == pieces


@pytest.mark.parametrize("pre,bos", [("gpt2", []), ("smollm", []), ("llama-bpe", [0]),
                                     ("qwen2", [])])
def test_bos_is_added_by_default_only_where_llama_cpp_adds_it(pre, bos):
    tok = tokenizer_from_gguf(byte_alphabet_meta(pre) | {"tokenizer.ggml.bos_token_id": 0})
    assert tok.encode("a") == bos + [tok.token_to_id("a")]


# --- a SentencePiece-style ("llama") vocabulary ------------------------------------------

# In merge order, as SentencePiece's BPE trainer ranks pieces (each is two earlier ones).
MERGED = ["▁t", "he", "▁the", "ll", "▁w", "or", "ld", "orld", "▁world", "▁h", "▁he", "llo",
          "▁hello", "an", "▁a", "▁an", "nd", "▁and", "is", "▁is", "▁▁", "▁▁▁", "in", "▁in"]
CHARS = ["▁", "t", "h", "e", "l", "o", "w", "r", "d", "a", "n", "i", "s"]


def write_spm_gguf(path: Path, **kv) -> Path:
    tokens = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
              + MERGED + CHARS + ["<|end|>"])
    types = [2, 3, 3] + [6] * 256 + [1] * (len(MERGED) + len(CHARS)) + [3]
    scores = ([0.0] * 259 + [-float(i) for i in range(len(MERGED))]
              + [-100.0 - i for i in range(len(CHARS))] + [0.0])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory) -> Path:
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")


@pytest.fixture(scope="module")
def spm(spm_file):
    return tokenizer_from_gguf(gguf_meta(spm_file))


def test_spm_encodes_and_decodes_as_transformers(spm, spm_file):
    ref = transformers.AutoTokenizer.from_pretrained(spm_file.parent, gguf_file=spm_file.name)
    for text in ["hello world", "the world and the hello", "is this hell", "helloworld in",
                 "the ünïcödé 🙂 hello",  # unknown characters: byte fallback
                 "and\tthen\n", "hello</s>", "x", ""]:
        ids = spm.encode(text)
        assert ids == list(ref(text)["input_ids"]), text
        assert spm.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text.replace(
            "</s>", "")


def pieces(tokenizer, text: str) -> list[str]:
    return [tokenizer.id_to_token(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def test_spm_leading_spaces_and_text_after_specials_follow_sentencepiece(spm):
    # SentencePiece and llama.cpp put "▁" before the text even when it starts with a space,
    # and llama.cpp again after each special token. transformers 5's GGUF tokenizer
    # (Metaspace, prepend_scheme "first") skips both, so it loses a space here: checked by
    # hand against the merge order above (and once against sentencepiece 0.2 itself).
    assert pieces(spm, " hello") == ["▁", "▁hello"]
    assert pieces(spm, " ") == ["▁▁"]
    assert pieces(spm, "   ") == ["▁▁", "▁▁"]
    assert pieces(spm, "  the  world") == ["▁▁", "▁the", "▁", "▁world"]
    assert pieces(spm, "hello<|end|>world") == ["▁hello", "<|end|>", "▁world"]
    for text in (" hello", "   ", "  the  world"):
        assert spm.decode(spm.encode(text)) == text


def test_spm_byte_fallback_and_bos(spm):
    assert pieces(spm, "é") == ["▁", "<0xC3>", "<0xA9>"]
    assert spm.encode("the")[0] == 1  # add_bos_token absent: "llama" files add BOS
    assert spm.encode("the", add_special_tokens=False) == [spm.token_to_id("▁the")]
    assert spm.decode([1, spm.token_to_id("▁the"), 2]) == "the"


def test_spm_flags(tmp_path):
    meta = gguf_meta(write_spm_gguf(tmp_path / "f.gguf", add_bos_token=False,
                                    add_eos_token=True, add_space_prefix=False))
    tok = tokenizer_from_gguf(meta)
    assert pieces(tok, "hello world") == ["he", "llo", "▁world"]
    assert tok.encode("the") == [tok.token_to_id("t"), tok.token_to_id("he"), 2]
    assert tok.decode(tok.encode(" the")) == " the"


def test_spm_merges_in_the_file_are_used(spm_file):
    meta = gguf_meta(spm_file) | {"tokenizer.ggml.merges": ["▁ t", "h e", "▁t he"]}
    tok = tokenizer_from_gguf(meta)
    assert pieces(tok, "the hello") == ["▁the", "▁", "he", "l", "l", "o"]


# --- refusals ----------------------------------------------------------------------------

def test_unknown_tokenizer_model_is_named(smollm_meta):
    with pytest.raises(ModelError, match="'xyz' is not supported; supported: gpt2, llama"):
        tokenizer_from_gguf(smollm_meta | {"tokenizer.ggml.model": "xyz"})
    with pytest.raises(ModelError, match="has no tokenizer \\(no tokenizer.ggml.model\\)"):
        tokenizer_from_gguf({})


def test_unknown_pre_tokenizer_is_named():
    with pytest.raises(ModelError, match="unknown pre-tokenizer 'abc'"):
        tokenizer_from_gguf(byte_alphabet_meta("abc"))


@pytest.mark.parametrize("change,message", [
    ({"tokenizer.ggml.tokens": None}, "no tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.tokens": []}, "no tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.tokens": [1, 2]}, "non-string"),
    ({"tokenizer.ggml.merges": ["a b c"]}, "malformed entry 'a b c'"),
    ({"tokenizer.ggml.merges": ["zz# q%"]}, "inconsistent"),
    ({"tokenizer.ggml.token_type": [1]}, "token_type has 1 entries"),
    ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 999},
     "bos token id 999"),
])
def test_broken_byte_level_metadata_is_a_model_error(change, message):
    with pytest.raises(ModelError, match=message):
        tokenizer_from_gguf(byte_alphabet_meta("gpt2") | change)


def test_merges_are_needed_only_beyond_single_bytes():
    """GGUF writers drop an empty merges list: a vocabulary of single bytes needs none,
    one with longer tokens would silently tokenize byte by byte without them."""
    alphabet = byte_alphabet_meta("gpt2") | {"tokenizer.ggml.merges": None}
    assert tokenizer_from_gguf(alphabet).encode("ab") == \
        [alphabet["tokenizer.ggml.tokens"].index(c) for c in "ab"]
    longer = alphabet | {"tokenizer.ggml.tokens": alphabet["tokenizer.ggml.tokens"] + ["ab"]}
    with pytest.raises(ModelError, match="no tokenizer.ggml.merges"):
        tokenizer_from_gguf(longer)


def test_spm_without_scores_or_merges_is_a_model_error(spm_file):
    meta = gguf_meta(spm_file)
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ModelError, match="neither tokenizer.ggml.merges nor tokenizer.ggml.scores"):
        tokenizer_from_gguf(meta)
