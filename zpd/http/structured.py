"""Structured output on the HTTP routes: SGLang's `regex`, `json_schema` and `ebnf`
(in /generate's sampling_params, or beside OpenAI's fields) and OpenAI's
`response_format`, each turned into the engine's constraint (engines/constraint.py)
and compiled once here, so a grammar that cannot compile is a 400 naming its field
before any worker sees it. The workers compile it again against the model's
vocabulary (engines/grammar.py)."""
from __future__ import annotations

import json
from typing import Any

from engines.constraint import GRAMMAR_KINDS, Constraint
from engines.grammar import check
from zpd.http.records import BadRequest

ANY_OBJECT = '{"type": "object"}'        # response_format json_object: any JSON object


def grammar_sampling(fields: dict[str, Any], where: str = "") -> dict:
    """The engine's sampling entry for the one constraint among `fields` (field name ->
    value; None: absent), {} for none: `where` + name in every error."""
    given = {k: v for k, v in fields.items() if v is not None}
    if len(given) > 1:
        raise BadRequest(f"only one of {', '.join(repr(where + k) for k in given)} may be given")
    if not given:
        return {}
    name, text = next(iter(given.items()))
    kind = name if name in GRAMMAR_KINDS else "json_schema"
    if type(text) is not str or not text:
        raise BadRequest(f"'{where}{name}' must be a non-empty string")
    try:
        check(Constraint(kind, text), where)
    except ValueError as e:
        message = str(e)
        if name != kind:          # response_format: named as the body has it
            message = message.replace(f"'{where}{kind}'", f"'{where}{name}.json_schema.schema'")
        raise BadRequest(message) from None
    return {kind: text}


def response_format(value: Any) -> str | None:
    """OpenAI's response_format as a JSON schema's text (None: plain text): json_object
    asks any JSON object, json_schema its `json_schema.schema`."""
    if value is None:
        return None
    if type(value) is not dict:
        raise BadRequest("'response_format' must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise BadRequest("'response_format.type' must be \"text\", \"json_object\" or "
                         f"\"json_schema\", not {str(kind)[:40]!r}")
    spec = value.get("json_schema")
    if type(spec) is not dict:
        raise BadRequest("'response_format.json_schema' must be an object")
    schema = spec.get("schema")
    if type(schema) not in (dict, bool):
        raise BadRequest("'response_format.json_schema.schema' must be a JSON schema (an object)")
    return json.dumps(schema)
