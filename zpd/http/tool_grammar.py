"""The grammar of a forced tool call (tool_choice "required" or a named function), as
the EBNF that SGLang's `ebnf` sampling field takes (GBNF: llama.cpp's notation, which
xgrammar reads and llguidance converts).

The call is written in the parser's own shape, so the model keeps the format it was
trained on: hermes / qwen25 `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
llama3 `{"name": "f", "parameters": {...}}` (several joined by "; "). The arguments
follow the tool's `parameters` JSON schema: objects with their properties in the
schema's order (required ones always, optional ones where the model writes them, no
others), strings, numbers, integers, booleans, null, arrays of `items`, `enum`,
`const`, `anyOf` / `oneOf` and lists of types. Keywords that bound values (pattern,
minimum, maxLength, ...) are not enforced, and a schema using `$ref` or `allOf` takes
any JSON value there: the parser reads the call either way. Between JSON tokens at
most one space or line break is allowed, as json_schema's compact default
(engines/grammar.py): given free whitespace, a weak model can write blanks forever.
"""
from __future__ import annotations

import json
from typing import Any

# Any JSON value, and the pieces of the schema's types (GBNF).
BASE_RULES = r'''ws ::= [ \n]?
json-string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] ) )* "\""
json-integer ::= "-"? ( "0" | [1-9] [0-9]* )
json-number ::= json-integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
json-boolean ::= "true" | "false"
json-null ::= "null"
json-array ::= "[" ws ( json-value ( ws "," ws json-value )* )? ws "]"
json-object ::= "{" ws ( json-string ws ":" ws json-value ( ws "," ws json-string ws ":" ws json-value )* )? ws "}"
json-value ::= json-object | json-array | json-string | json-number | json-boolean | json-null'''

MAX_DEPTH = 16         # nesting read from a schema; deeper values are any JSON
TYPES = {"string": "json-string", "integer": "json-integer", "number": "json-number",
         "boolean": "json-boolean", "null": "json-null"}
FORMS = {  # parser -> text before the name, between the name and the arguments, after
    # them; the rule between two calls
    "hermes": ('<tool_call>\n{"name": ', ', "arguments": ', '}\n</tool_call>', "ws"),
    "llama3": ('{"name": ', ', "parameters": ', "}", '"; "'),
}
FORMS["qwen25"] = FORMS["hermes"]


def forced_call_grammar(parser: str, tools: list[dict], parallel: bool = True) -> str:
    """The EBNF whose sentences are one call (or, with `parallel`, one or more) of
    `tools` (OpenAI function tools) written as `parser` reads them."""
    if parser not in FORMS:
        raise ValueError(f"no forced-call grammar for the {parser!r} tool-call parser")
    if not tools:
        raise ValueError("a forced tool call needs at least one tool")
    before, middle, after, between = FORMS[parser]
    rules: list[str] = []
    calls = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = fn.get("parameters")
        args = _schema_rule(params, f"t{i}-args", rules) if params else '"{}"'   # no arguments
        head = before + json.dumps(fn["name"], ensure_ascii=False) + middle
        calls.append(f"{_literal(head)} {args} {_literal(after)}")
    rules.insert(0, "call ::= " + " | ".join(f"( {c} )" for c in calls))
    root = f"root ::= call ( {between} call )*" if parallel else "root ::= call"
    return "\n".join([root, *rules, BASE_RULES]) + "\n"


def _literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _schema_rule(schema: Any, name: str, rules: list[str], depth: int = 0) -> str:
    """A rule (or base rule) name whose sentences are the JSON values `schema` allows
    (any value below MAX_DEPTH levels of nesting)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return "json-value"            # true, or a schema this does not read: any value
    depth += 1
    if "const" in schema:
        return _define(name, _literal(json.dumps(schema["const"], ensure_ascii=False)), rules)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return _define(name, " | ".join(_literal(json.dumps(v, ensure_ascii=False))
                                        for v in schema["enum"]), rules)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            alts = [_schema_rule(s, f"{name}-{j}", rules, depth)
                    for j, s in enumerate(schema[key])]
            return _define(name, " | ".join(alts), rules)
    kind = schema.get("type")
    if isinstance(kind, list) and kind and all(k in TYPES or k in ("array", "object")
                                               for k in kind if isinstance(k, str)):
        alts = [_schema_rule(schema | {"type": k}, f"{name}-{j}", rules, depth)
                for j, k in enumerate(kind) if isinstance(k, str)]
        return _define(name, " | ".join(alts), rules) if alts else "json-value"
    if not isinstance(kind, str):
        return "json-value"
    if kind in TYPES:
        return TYPES[kind]
    if kind == "array":
        item = _schema_rule(schema.get("items", True), f"{name}-item", rules, depth)
        return _define(name, f'"[" ws ( {item} ( ws "," ws {item} )* )? ws "]"', rules)
    if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return _object_rule(schema, name, rules, depth)
    if kind == "object":
        return "json-object"
    return "json-value"


def _object_rule(schema: dict, name: str, rules: list[str], depth: int) -> str:
    """An object with the schema's properties in order: the required ones always, each
    optional one where the model writes it, none other."""
    props = list(schema["properties"].items())
    given = schema.get("required")
    required = {r for r in given if isinstance(r, str)} if isinstance(given, list) else set()
    values = [_schema_rule(s, f"{name}-{j}", rules, depth) for j, (_, s) in enumerate(props)]
    pairs = [f'{_literal(json.dumps(k, ensure_ascii=False))} ws ":" ws {v}'
             for (k, _), v in zip(props, values)]

    made: dict[tuple[int, bool], tuple[str | None, bool]] = {}

    # tail(i, lead): the properties from i on, each led by a comma when `lead` (one was
    # written before); a rule name and whether it may be empty (then it is used with ?).
    def tail(i: int, lead: bool) -> tuple[str | None, bool]:
        if (i, lead) not in made:
            made[i, lead] = rule(i, lead)
        return made[i, lead]

    def rule(i: int, lead: bool) -> tuple[str | None, bool]:
        if i == len(props):
            return None, True
        rest, rest_empty = tail(i + 1, True)
        this = ('"," ws ' if lead else "") + pairs[i] + (
            f" ws {rest}{'?' if rest_empty else ''}" if rest else "")
        if props[i][0] in required:
            return _define(f"{name}-{i}{'c' if lead else 'f'}", this, rules), False
        skip, skip_empty = tail(i + 1, lead)
        body = this if skip is None else f"{this} | {skip}"
        return _define(f"{name}-{i}{'c' if lead else 'f'}", body, rules), skip_empty
    first, empty = tail(0, False)
    return _define(name, f'"{{" ws {first}{"?" if empty else ""} ws "}}"', rules)


def _define(name: str, body: str, rules: list[str]) -> str:
    rules.append(f"{name} ::= {body}")
    return name
