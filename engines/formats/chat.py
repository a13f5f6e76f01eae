"""Chat messages -> prompt text, with the model's own Jinja chat template.

Templates come from model files (GGUF metadata, tokenizer_config.json) and messages
come from the network, so templates run in Jinja's immutable sandbox and messages are
checked before rendering. Rendering follows what Hugging Face's apply_chat_template
does (trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII text), so a template prints here what it prints there.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
from jinja2.ext import loopcontrols
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engines.config import ModelError
from engines.formats.tokenizer import Tokenizer

MAX_MESSAGES = 1024


class TemplateRaised(ValueError):
    """The chat template rejected the conversation (its `raise_exception` call)."""


class ChatTemplate:
    """A compiled chat template and the BOS/EOS text it may refer to."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelError(f"chat template has a syntax error (line {e.lineno}): "
                             f"{e.message}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: Mapping[str, Any] | None = None) -> str:
        """Prompt text for `messages`; ValueError when they (or the template) refuse.
        `tools`: the template's `tools` (OpenAI's tool objects, as HF passes them; None
        leaves it undefined); `variables`: more of the template's variables (an API's
        chat_template_kwargs, e.g. Qwen3's enable_thinking), which may also set the
        special tokens' text as in HF, never messages, tools or add_generation_prompt."""
        check_messages(messages)
        check_tools(tools)
        extra = check_variables(variables)
        given = {"tools": tools} if tools is not None else {}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                **given, **(self._special_tokens() | extra))
        except TemplateRaised:
            raise
        except SecurityError as e:
            raise ValueError(f"chat template was refused by the sandbox: {e}") from None
        # A template failing on these messages is a bad request, not a server fault.
        except (jinja2.TemplateError, ValueError, TypeError, LookupError,
                ArithmeticError) as e:
            raise ValueError(f"chat template failed on these messages: {e}") from None

    def _special_tokens(self) -> dict[str, str]:
        # An absent token stays undefined, as in HF, so `is defined` tests agree.
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return {k: v for k, v in tokens.items() if v is not None}

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tokenizer: Tokenizer) -> ChatTemplate | None:
        """The template in GGUF metadata, or None when the file has none."""
        source = meta.get("tokenizer.chat_template")
        if not source:
            return None
        if not isinstance(source, str):
            raise ModelError("GGUF tokenizer.chat_template is not a string")
        return cls(source, _token_text(meta, "bos", tokenizer), _token_text(meta, "eos", tokenizer))

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer: Tokenizer | None = None) -> ChatTemplate | None:
        """The template of a Hugging Face model directory, or None when it has none.

        `tokenizer` is unused: BOS/EOS text is in tokenizer_config.json; the parameter
        keeps the signature that of from_gguf."""
        root = Path(path)
        config = _read_tokenizer_config(root / "tokenizer_config.json")
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            source = _read_text(jinja_file)
        else:
            source = _template_from_config(config)
        if not source:
            return None
        return cls(source, _config_token(config, "bos_token"), _config_token(config, "eos_token"))


def check_messages(messages: Any) -> None:
    """Refuse anything but a non-empty list of {"role": str, "content": str, ...}; an
    assistant turn's `tool_calls` must be a list of objects."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"too many messages ({len(messages)} > {MAX_MESSAGES})")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}].{key} must be a string")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list)
                                      and all(isinstance(c, dict) for c in calls)):
            raise ValueError(f"messages[{i}].tool_calls must be a list of objects")


def check_tools(tools: Any) -> None:
    """None, or a list of objects (their contents are the template's to read)."""
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of objects")


RESERVED_VARIABLES = ("messages", "tools", "add_generation_prompt")


def check_variables(variables: Any) -> dict:
    """The extra template variables as a dict; ValueError for a non-object or a name
    the renderer sets itself."""
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise ValueError("chat template variables must be an object")
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"chat template variable {str(name)[:100]!r} is not a name")
        if name in RESERVED_VARIABLES:
            raise ValueError(f"chat template variable {name!r} is set by the server; "
                             "give it in its own field")
    return dict(variables)


def encode_chat(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict],
                tools: list[dict] | None = None,
                variables: Mapping[str, Any] | None = None) -> list[int]:
    """Prompt ids for a conversation (with `tools` and more `variables` for the template,
    see ChatTemplate.render). The template writes BOS itself where the model wants one,
    so encode() must not add another."""
    return tokenizer.encode(template.render(messages, tools=tools, variables=variables),
                            add_special_tokens=False)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox, but touching an unsafe attribute fails at once: by default it
    only yields an undefined value, so `{{ f.__globals__ }}` would print "" and the
    probe would go unnoticed."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__} is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _raise_exception(message: str) -> None:
    raise TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and non-ASCII for HTML; prompts want the text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _token_text(meta: Mapping[str, Any], which: str, tokenizer: Tokenizer) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
    return None if token_id is None else tokenizer.id_to_token(int(token_id))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as e:
        raise ModelError(f"{path}: cannot read: {e}") from None


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(_read_text(path))
    except ValueError as e:
        raise ModelError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: not a JSON object")
    return config


def _template_from_config(config: dict) -> str | None:
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates; the unnamed use is "default"
        source = next((t.get("template") for t in source
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    if source is not None and not isinstance(source, str):
        raise ModelError("tokenizer_config.json: chat_template is neither a string "
                         "nor a list of {name, template}")
    return source


def _config_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # the serialized AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) else None
