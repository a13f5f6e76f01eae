"""What a user may put in place of a model's own tokenizer, chat template and context
length (SGLang's --tokenizer-path, --chat-template, --context-length). Each override is
honoured exactly or refused with a ModelError naming its flag: a silently ignored one
would serve other prompt ids than the user asked for."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from engines.formats.chat import ChatTemplate
from engines.config import ModelConfig, ModelError
from engines.formats.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelOverrides:
    """None: the model's own. Every worker and the HTTP front of a cluster must be given
    the same (workers check it: the tokenizer and template are in their compatibility
    hash)."""
    tokenizer_path: str | None = None   # tokenizer.json, a directory with one, or a .gguf file
    chat_template: str | None = None    # a template file, or the Jinja template itself
    context_length: int | None = None   # at most the model's own (max_position_embeddings)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with the context length lowered; ModelError past the model's own."""
        n = self.context_length
        if n is None:
            return cfg
        if not 0 < n <= cfg.max_position:
            # Rotary tables and training end at the model's own length; SGLang needs an
            # opt-in environment variable to go past it, and zpd has no such mode.
            raise ModelError(f"--context-length {n}: must be in 1..{cfg.max_position} "
                             "(the model's own context length)")
        return replace(cfg, max_position=n)

    def text(self, cfg: ModelConfig, tokenizer: Tokenizer | None, chat: ChatTemplate | None,
             problem: str) -> tuple[Tokenizer | None, ChatTemplate | None, str]:
        """(tokenizer, chat template, why text cannot be served) after the overrides."""
        if self.tokenizer_path is not None:
            tokenizer, own_chat = load_tokenizer(self.tokenizer_path, cfg)
            # A tokenizer's directory or file carries its template, as Hugging Face's does.
            chat, problem = own_chat, "" if own_chat else \
                f"tokenizer {self.tokenizer_path!r} has no chat template"
        if self.chat_template is not None:
            if tokenizer is None:
                raise ModelError(f"--chat-template: {problem or 'the model has no tokenizer'} "
                                 "(give --tokenizer-path)")
            chat, problem = load_template(self.chat_template, chat), ""
        return tokenizer, chat, problem


def load_tokenizer(path: str, cfg: ModelConfig) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer at `path` and the chat template beside it (None if none)."""
    # Imported here: reading GGUF needs torch, and zpd's configs (which a router loads
    # without torch) hold a ModelOverrides.
    from engines.formats.gguf_file import GGUFFile, is_gguf
    from engines.formats.vocab import tokenizer_from_gguf
    p = Path(path)
    if is_gguf(path):
        meta = GGUFFile(path).meta
        tokenizer = tokenizer_from_gguf(meta)
        chat = ChatTemplate.from_gguf(meta, tokenizer)
    elif p.is_dir() and (p / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(p / "tokenizer.json")
        chat = ChatTemplate.from_dir(p, tokenizer)
    elif p.is_file() and p.suffix == ".json":
        tokenizer, chat = Tokenizer.from_file(p), None
    else:
        raise ModelError(f"--tokenizer-path {path!r}: neither a tokenizer.json, a directory "
                         "holding one, nor a .gguf file (hub names are not fetched)")
    size = tokenizer.inner.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise ModelError(f"--tokenizer-path {path!r}: {size} tokens, more than the model's "
                         f"vocabulary of {cfg.vocab_size}")
    return tokenizer, chat


def load_template(value: str, own: ChatTemplate | None) -> ChatTemplate:
    """A chat template from a file, or `value` itself when it is Jinja; BOS and EOS text
    stay the model's (a template file carries none)."""
    if looks_like_template(value):
        source = value          # never a path: a long one would fail os.stat (ENAMETOOLONG)
    else:
        p = Path(value)
        try:
            found = p.is_file()
        except OSError as e:            # a name longer than 255 bytes, say
            raise ModelError(f"--chat-template {value[:200]!r}: not a file: {e.strerror}") from None
        if not found:
            raise ModelError(f"--chat-template {value!r}: no such file, and not a Jinja template "
                             "(SGLang's built-in template names are not supported)")
        if p.suffix == ".json":
            raise ModelError(f"--chat-template {value!r}: SGLang's JSON conversation templates "
                             "are not supported; give a Jinja template file")
        try:
            source = p.read_text(encoding="utf-8")
        except (OSError, UnicodeError) as e:
            raise ModelError(f"--chat-template {value!r}: cannot read: {e}") from None
    return ChatTemplate(source, own.bos_token if own else None, own.eos_token if own else None)


def looks_like_template(value: str) -> bool:
    """Whether --chat-template's value is template text rather than a file name: Jinja
    markup, a line break, a NUL, or longer than any path the system takes."""
    return ("{{" in value or "{%" in value or "\n" in value or "\0" in value
            or len(value.encode("utf-8", "surrogateescape")) > PATH_MAX)


PATH_MAX = 4096     # Linux's; a single name is at most 255 bytes (both: ENAMETOOLONG)
