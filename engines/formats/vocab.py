"""A `tokenizers` tokenizer rebuilt from a GGUF file's tokenizer.ggml.* metadata.

Two vocabulary kinds are supported, the ones llama.cpp calls "gpt2" (byte-level BPE:
Llama 3, Qwen2, SmolLM, ...) and "llama" (SentencePiece BPE with byte fallback:
Llama 2, TinyLlama, Mistral). Anything else is refused with a ModelError, because a
tokenizer that splits text slightly differently from the one the model was trained
with corrupts every prompt without any visible error.
"""
from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engines.config import ModelError
from engines.formats.tokenizer import Tokenizer

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama")

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> how text is split before byte-level BPE (llama.cpp's groups).
_GPT2_PRE = {"default", "gpt2", "mpt", "olmo"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}
# llama.cpp takes a whole pre-token that is itself in the vocabulary before trying
# merges for these (as Llama 3's tokenizer.json does with "ignore_merges"), and adds
# BOS to a prompt when the file does not say.
_LLAMA3_DEFAULTS_PRE = {"llama-bpe", "llama3", "llama-v3", "falcon3"}

SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """Build the tokenizer that GGUF metadata `meta` (key -> Python value) describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelError("the GGUF file has no tokenizer (no tokenizer.ggml.model)")
    if kind not in SUPPORTED_MODELS:
        raise ModelError(f"GGUF tokenizer model {kind!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODELS)}")
    tokens = _tokens(meta)
    types = _token_types(meta, len(tokens))
    inner = _byte_level(meta, tokens) if kind == "gpt2" else _sentencepiece(meta, tokens, types)
    _add_vocab_tokens(inner, tokens, types)
    default_bos = kind == "llama" or meta.get("tokenizer.ggml.pre") in _LLAMA3_DEFAULTS_PRE
    _set_post_processor(inner, meta, tokens, default_bos)
    return Tokenizer(inner)


def _tokens(meta: Mapping[str, Any]) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError("GGUF file has no tokenizer.ggml.tokens")
    if not all(isinstance(t, str) for t in tokens):
        raise ModelError("GGUF tokenizer.ggml.tokens holds non-string entries")
    return list(tokens)


def _token_types(meta: Mapping[str, Any], n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * n
    if len(types) != n:
        raise ModelError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries "
                         f"for {n} tokens")
    return [int(t) for t in types]


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicated token keeps its first id
    return vocab


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    raw = meta.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    merges = []
    for m in raw:
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2:
            raise ModelError(f"GGUF tokenizer.ggml.merges has a malformed entry {m!r}")
        merges.append((parts[0], parts[1]))
    return merges


def _bpe(**kwargs: Any) -> models.BPE:
    try:
        return models.BPE(**kwargs)
    except Exception as e:  # the library raises bare Exception for bad merges
        raise ModelError(f"GGUF tokenizer is inconsistent: {e}") from None


# --- "gpt2": byte-level BPE ---------------------------------------------------------

def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> HFTokenizer:
    merges = _merges(meta)
    types = _token_types(meta, len(tokens))
    # A vocabulary of single bytes needs no merges (GGUF writers drop an empty list);
    # any longer normal token does, or every text would silently split into bytes.
    if merges is None and any(len(t) > 1 for t, k in zip(tokens, types) if k == NORMAL):
        raise ModelError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    inner = HFTokenizer(_bpe(vocab=_vocab(tokens), merges=merges or [],
                             ignore_merges=pre in _LLAMA3_DEFAULTS_PRE))
    inner.pre_tokenizer = _pre_tokenizer(pre)
    inner.decoder = decoders.ByteLevel()
    return inner


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return gpt2
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    regex = LLAMA3_REGEX if pre in _LLAMA3_PRE else QWEN2_REGEX if pre in _QWEN2_PRE else None
    if regex is None:
        raise ModelError(f"GGUF tokenizer has an unknown pre-tokenizer {pre!r} "
                         "(tokenizer.ggml.pre); its text splitting is not implemented")
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# --- "llama": SentencePiece BPE -----------------------------------------------------

def _sentencepiece(meta: Mapping[str, Any], tokens: list[str],
                   types: list[int]) -> HFTokenizer:
    merges = _merges(meta)
    if merges is None:
        merges = derived_merges(tokens, types, _scores(meta, len(tokens)))
    inner = HFTokenizer(_bpe(vocab=_vocab(tokens), merges=merges, byte_fallback=True,
                             unk_token=_unk(meta, tokens, types), fuse_unk=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    inner.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE)] if prefix else []) + [normalizers.Replace(" ", SPACE)])
    inner.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return inner


def _scores(meta: Mapping[str, Any], n: int) -> list[float]:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ModelError("GGUF SentencePiece tokenizer has neither tokenizer.ggml.merges "
                         "nor tokenizer.ggml.scores")
    if len(scores) != n:
        raise ModelError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    return [float(s) for s in scores]


def derived_merges(tokens: list[str], types: list[int],
                   scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every way to write a normal
    token as two normal tokens, the best-scored results first (SentencePiece merges
    the pair whose result scores highest)."""
    normal = {t for t, k in zip(tokens, types) if k == NORMAL}
    found = []
    for i, tok in enumerate(tokens):
        if types[i] != NORMAL:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in normal and right in normal:
                found.append((-scores[i], i, cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _unk(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> str | None:
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, k in enumerate(types) if k == UNKNOWN), None)
    return None if unk_id is None else tokens[_checked_id(unk_id, len(tokens), "unknown")]


# --- shared --------------------------------------------------------------------------

def _add_vocab_tokens(inner: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    # Control tokens are matched in text and skipped by decode; user-defined ones are
    # matched whole but are ordinary text. Neither is normalized first.
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k == CONTROL and t]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED and t]
    inner.add_special_tokens(special)
    inner.add_tokens(user)


def _set_post_processor(inner: HFTokenizer, meta: Mapping[str, Any], tokens: list[str],
                        default_bos: bool) -> None:
    bos = _optional_token(meta, tokens, "bos", default_bos)
    eos = _optional_token(meta, tokens, "eos", False)
    if bos is None and eos is None:
        return
    pre = [bos[0]] if bos else []
    post = [eos[0]] if eos else []
    inner.post_processor = processors.TemplateProcessing(
        single=pre + ["$A"] + post,
        pair=pre + ["$A"] + post + pre + ["$B:1"] + post,
        special_tokens=[t for t in (bos, eos) if t])


def _optional_token(meta: Mapping[str, Any], tokens: list[str], which: str,
                    default: bool) -> tuple[str, int] | None:
    """(text, id) of BOS or EOS when encode() should add it, else None."""
    wanted = meta.get(f"tokenizer.ggml.add_{which}_token")
    token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
    if not (default if wanted is None else wanted) or token_id is None:
        return None
    token_id = _checked_id(token_id, len(tokens), which)
    return tokens[token_id], token_id


def _checked_id(token_id: Any, n: int, which: str) -> int:
    if not isinstance(token_id, int) or not 0 <= token_id < n:
        raise ModelError(f"GGUF {which} token id {token_id!r} is outside the vocabulary ({n})")
    return token_id
