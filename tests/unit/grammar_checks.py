"""What the structured-output tests check outputs against: Python's own `re` for a
regex, json.loads and a small schema check (the few keywords the tests' schemas use)
for a JSON schema; no validator package."""
from __future__ import annotations

import json
import re
from typing import Any

# Bounded, so even a random model's output completes: a sampled tiny model draws
# anything the mask allows, and an unbounded string might never close.
REGEX = r"[0-9]{2,5}-(ab|cd)+x"
SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tag": {"enum": ["red", "green", "blue"]},
                         "s": {"type": "string", "maxLength": 5}},
          "required": ["n", "ok", "tag", "s"], "additionalProperties": False}
EBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'
# ~300 tokens of a byte-level vocabulary: long enough to be caught by a pause mid-way
LONG_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "s": {"type": "string", "minLength": 300, "maxLength": 300}},
               "required": ["n", "s"], "additionalProperties": False}


def matches(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


def conforms(value: Any, schema: dict) -> bool:
    """`value` satisfies `schema` (type, enum, minimum, maximum, maxLength, properties,
    required, additionalProperties: false)."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "integer":
        return type(value) is int and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "boolean":
        return type(value) is bool
    if kind == "string":
        return type(value) is str and len(value) <= schema.get("maxLength", len(value))
    if kind == "object":
        props = schema.get("properties", {})
        return type(value) is dict and all(k in value for k in schema.get("required", ())) and \
            (schema.get("additionalProperties", True) or set(value) <= set(props)) and \
            all(conforms(v, props[k]) for k, v in value.items() if k in props)
    return kind is None


def valid_json(text: str, schema: dict = SCHEMA) -> bool:
    try:
        return conforms(json.loads(text), schema)
    except ValueError:
        return False
