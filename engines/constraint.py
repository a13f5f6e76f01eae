"""A request's output constraint: which grammar, and its text. Plain Python, no grammar
library: the HTTP front, the clients and the wire carry it; engines/grammar.py compiles it.

This is the internal API for anything that constrains output (the routes' `regex`,
`json_schema` and `ebnf`, OpenAI's `response_format`, a forced tool call): set one of
SamplingParams' fields of the same name to the text; `SamplingParams.constraint` gives
the record back."""
from __future__ import annotations

from dataclasses import dataclass

# SGLang's sampling_params names: a regular expression (Rust regex syntax, the whole
# output matches it), a JSON schema as JSON text, an EBNF grammar (llama.cpp's GBNF,
# `root ::= ...`, as SGLang takes it, or a Lark grammar with `start:`).
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")
# A schema or grammar's length: it travels in each generate and recompute message
# (16 MiB frames), and each distinct one is kept compiled while it is in use.
MAX_GRAMMAR_CHARS = 1 << 18


@dataclass(frozen=True)
class Constraint:
    """What a request's output must follow: `kind` one of GRAMMAR_KINDS, `text` its source."""
    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"a constraint is one of {', '.join(GRAMMAR_KINDS)}, not {self.kind!r}")

    def as_sampling(self) -> dict:
        """The sampling parameter that asks for it: {kind: text}."""
        return {self.kind: self.text}
