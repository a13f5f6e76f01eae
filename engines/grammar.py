"""Constrained decoding with llguidance: a request's regex, JSON schema or EBNF grammar
(engines/constraint.py) compiled against the model's vocabulary, and each request's
matcher, which says which tokens may come next and follows the tokens emitted.

Why llguidance: one binary wheel with no Python dependencies (xgrammar, SGLang's
default, pulls in transformers and triton), kept by Microsoft's guidance team, and
SGLang and vLLM both serve it as a backend; regular expressions, JSON schemas and Lark
grammars, and llama.cpp's GBNF (SGLang's `ebnf`) converted to Lark. Its grammars
compile lazily, token by token: a schema's first matcher takes about a millisecond.

No torch here: the HTTP front checks a grammar with `check` before sending it.
engines/grammar_mask.py turns matchers into the logits mask.
"""
from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance as llg

from engines.constraint import Constraint
from engines.formats.tokenizer import Tokenizer

# JSON output as json.dumps writes it, whitespace fixed: with any whitespace allowed
# (llguidance's default, and xgrammar's) a weak model can emit blanks forever. A schema's
# own "x-guidance" object overrides these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 64         # distinct constraints kept compiled (LRU)
ANY_JSON = "$$ANY$$"         # SGLang's json_schema for any JSON value


def grammar_source(c: Constraint, where: str = "") -> str:
    """llguidance's grammar for `c`; ValueError naming `where` + the field when its text
    is not even of its kind (a schema that is not a JSON object, a GBNF with a missing rule)."""
    name = f"'{where}{c.kind}'"
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(c.text)
    if c.kind == "json_schema":
        if c.text == ANY_JSON:
            return llg.LLMatcher.grammar_from_lark("start: %json {}")
        try:
            schema = json.loads(c.text)
        except ValueError as e:
            raise ValueError(f"{name} is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{name} must be a JSON schema (an object), not {type(schema).__name__}")
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    try:
        return llg.grammar_from("ebnf", c.text)
    except ValueError as e:
        raise ValueError(f"{name} does not compile: {e}") from None


def check(c: Constraint, where: str = "") -> None:
    """ValueError naming the field when `c` cannot compile (no vocabulary needed). The
    last CACHED_GRAMMARS answers are remembered: a batch of 512 prompts sharing one
    schema compiles it once (a 200-property schema takes ~5 ms)."""
    error = _compile_error(c)
    if error is not None:
        raise ValueError(error.replace("'{where}", f"'{where}", 1))


@functools.lru_cache(maxsize=CACHED_GRAMMARS)     # a pure function's memo
def _compile_error(c: Constraint) -> str | None:
    """Why `c` cannot compile, its field named as "'{where}kind'"; None if it can."""
    try:
        error = llg.LLMatcher.validate_grammar(grammar_source(c, "{where}"))
    except ValueError as e:
        return str(e)
    return f"'{{where}}{c.kind}' does not compile: {_short(error)}" if error else None


class Matcher:
    """One request's grammar state: `consumed` of its output tokens followed so far."""

    def __init__(self, inner: llg.LLMatcher) -> None:
        self.inner, self.consumed = inner, 0
        self.problem = ""                  # why its output left the grammar ("": it has not)

    def follow(self, output: list[int]) -> bool:
        """Consume the output tokens it has not seen (a decode's first token from the
        prefill, everything on a matcher rebuilt): False once one breaks the grammar."""
        while not self.problem and self.consumed < len(output):
            token = output[self.consumed]
            if not self.inner.consume_token(token):
                self.problem = f"output token {token} (position {self.consumed}) breaks its " \
                               f"grammar: {_short(self.inner.get_error())}"
            self.consumed += 1
        return not self.problem

    @property
    def ended(self) -> bool:
        """The grammar is complete: nothing but an end token may follow (or has). Not
        once its output broke the grammar (llguidance calls that stopped too)."""
        return not self.problem and self.inner.is_stopped()


@dataclass
class _Entry:
    template: llg.LLMatcher | None
    error: str = ""


class Grammars:
    """A worker's compiled grammars over its model's vocabulary: `vocab` ids (the logits'
    width; ids the tokenizer lacks are never allowed) ending with `eos_ids`. The
    tokenizer's llguidance form is built on first use (SmolLM2's 49k tokens: 0.25 s) and
    the CACHED_GRAMMARS last constraints are kept compiled; each request's matcher is a
    copy (microseconds). `compile` may run on a helper thread (it releases the GIL)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab: int, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, tuple(eos_ids)
        self._llt: llg.LLTokenizer | None = None
        self._cache: OrderedDict[Constraint, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._llt_lock = threading.Lock()    # apart: `compiled` must not wait for its build

    def compiled(self, c: Constraint | None) -> bool:
        """Nothing to compile: no constraint, or one compiled (or refused) already."""
        with self._lock:
            return c is None or c in self._cache

    def compile(self, c: Constraint) -> None:
        """Compile `c` into the cache (its error too, so a bad grammar is refused at once)."""
        if self.compiled(c):
            return
        try:
            inner = llg.LLMatcher(self._tokenizer(), grammar_source(c, "sampling_params."),
                                  log_level=0)
            if not inner.is_error():
                inner.compute_bitmask()   # builds the lexer's first states: copies share them
            entry = _Entry(None, inner.get_error()) if inner.is_error() else _Entry(inner)
        except ValueError as e:
            entry = _Entry(None, str(e))
        with self._lock:
            self._cache[c] = entry
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)

    def check(self, c: Constraint | None) -> None:
        """ValueError naming the field when `c` does not compile."""
        if c is not None:
            self._entry(c)

    def matcher(self, c: Constraint) -> Matcher:
        return Matcher(self._entry(c).deep_copy())

    def _entry(self, c: Constraint) -> llg.LLMatcher:
        self.compile(c)
        with self._lock:
            entry = self._cache[c]
            self._cache.move_to_end(c)
        if entry.template is None:
            error = entry.error
            if not error.startswith("'"):
                error = f"'sampling_params.{c.kind}' does not compile: {_short(error)}"
            raise ValueError(error)
        return entry.template

    def _tokenizer(self) -> llg.LLTokenizer:
        if self.tokenizer is None:
            raise ValueError("constrained decoding needs the model's tokenizer, which this "
                             "model lacks")
        with self._llt_lock:
            if self._llt is None:
                self._llt = llg.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab,
                                            eos_token=list(self.eos_ids) or None)
            return self._llt


def _short(error: str) -> str:
    """llguidance's message, on one line and bounded (it quotes the grammar)."""
    text = " ".join(error.split())
    return text if len(text) <= 300 else text[:297] + "..."
