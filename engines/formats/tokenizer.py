"""Text <-> token ids via the `tokenizers` library (tokenizer.json)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engines.config import ModelError

SHORT_DECODE = 64       # ids decoded without releasing the GIL (see Tokenizer.decode)


class Tokenizer:
    """A thin wrapper so callers never depend on the library's types."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner
        self._ones: tuple[dict[int, str], dict[int, str]] = ({}, {})   # decode_one's, by skip
        # Byte-level BPE (GPT-2's, Llama 3's, Qwen's, SmolLM2's): each token decodes to
        # its own bytes, whatever its neighbours, so ids whose texts are whole UTF-8
        # decode to their texts joined. SentencePiece's do not (a leading space is
        # dropped at the start of a decode only).
        self.joins = type(inner.decoder) is decoders.ByteLevel

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # the library raises bare Exception subclasses
            raise ModelError(f"{path}: cannot load tokenizer: {e}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the model wants around a
        plain text (BOS for most), which a rendered chat prompt already contains.

        Through `encode_batch`, which releases the GIL while the Rust side works;
        `encode` does not. A megabyte of text takes about a second, during which a
        worker's ping responder thread must run (issue 30, item 3: a held GIL got both
        workers declared dead). Same ids, about 1 us more per call: no short-text path."""
        return self.inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < 2 ** 32:  # the library raises OverflowError outside u32
            return None
        return self.inner.id_to_token(token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (<|im_end|>, ...) shown only when not
        skipped (SGLang's `skip_special_tokens: false`). The library has no
        `spaces_between_special_tokens`: Hugging Face's fast tokenizers ignore it too.
        Through `decode_batch`, which releases the GIL (`decode` does not), as `encode`:
        a megabyte of ids takes ~0.2 s, during which the HTTP front's event loop runs.
        A few ids (the HTTP front's incremental decode, per streamed token) are decoded
        holding it: releasing it cost more than their decode (1.0 vs 0.5 us)."""
        if len(ids) <= SHORT_DECODE:
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.inner.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """`decode([token_id], skip_special_tokens)`, remembered (the HTTP front's
        incremental decode asks it once per streamed token)."""
        known = self._ones[skip_special_tokens]
        text = known.get(token_id)
        if text is None:
            text = known[token_id] = self.decode([token_id], skip_special_tokens)
        return text

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (how logprobs name a token)."""
        if not 0 <= token_id < 2 ** 32:
            return ""
        return self.inner.decode([token_id], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.inner.to_str()


def byte_tokenizer(bos_id: int, eos_id: int) -> Tokenizer:
    """One token per byte (ids 0..255) plus <bos>/<eos>: any text, no training."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps each byte to a printable character; order the vocab by byte value.
    byte_chars = sorted(alphabet, key=_byte_of_char)
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    inner = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens(["<bos>", "<eos>"])
    assert inner.token_to_id("<bos>") == bos_id and inner.token_to_id("<eos>") == eos_id
    return Tokenizer(inner)


def _byte_of_char(ch: str) -> int:
    # The GPT-2 byte-level map: printable bytes map to themselves, the rest to 256 + n.
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
