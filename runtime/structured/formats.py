"""What a caller asks the output to be: OpenAI's ``response_format``, checked.

    {"type": "text"}                                   -> None (unconstrained)
    {"type": "json_object"}                            -> any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}

The schema is compiled by llguidance (grammar.py); this module only checks the
request's shape, so that every mistake is an error naming the field at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from ..platform.errors import GenerationError

JSON_OBJECT, JSON_SCHEMA = "json_object", "json_schema"
TOOL_CALLS = "tool_calls"  # internal: a forced tool_choice (tools.call_grammar)
ANY_OBJECT: dict = {"type": "object"}
# A schema is compiled per request; refuse absurd ones before the compiler sees them.
MAX_SCHEMA_BYTES = 256 * 1024


class StructuredError(GenerationError):
    """A response format or tool declaration the runtime refuses; ``param``
    names the request field at fault (the server's 400 carries it)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # JSON_OBJECT | JSON_SCHEMA
    schema: dict
    name: str = ""
    strict: Optional[bool] = None
    where: str = "response_format"  # the request field it came from (errors name it)
    lark: Optional[str] = None  # TOOL_CALLS: the llguidance grammar itself

    def to_dict(self) -> dict:
        if self.kind == JSON_OBJECT:
            return {"type": JSON_OBJECT}
        spec: dict[str, Any] = {"name": self.name, "schema": self.schema}
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": JSON_SCHEMA, "json_schema": spec}


def json_object() -> ResponseFormat:
    return ResponseFormat(JSON_OBJECT, dict(ANY_OBJECT))


def json_schema(schema: dict, name: str = "schema", strict: Optional[bool] = None,
                where: str = "response_format") -> ResponseFormat:
    """A JSON-schema format; ``where``: the request field holding the schema's
    request ("response_format": the schema is its json_schema.schema)."""
    field = f"{where}.json_schema.schema" if where == "response_format" else where
    if not isinstance(schema, dict) or isinstance(schema, bool):
        raise StructuredError(f"'{field}' must be a JSON Schema object", field)
    from .limits import schema_problem  # before anything recurses into it (json.dumps, the engine)

    problem = schema_problem(schema)
    if problem:
        raise StructuredError(f"'{field}' {problem}", field)
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise StructuredError(f"'{field}' is {size} bytes; at most {MAX_SCHEMA_BYTES}", field)
    return ResponseFormat(JSON_SCHEMA, schema, name, strict, where)


def parse_response_format(value: Any, where: str = "response_format") -> Optional[ResponseFormat]:
    """The ResponseFormat an OpenAI ``response_format`` asks for (None: plain
    text), or StructuredError naming the field at fault."""
    if value is None:
        return None
    if isinstance(value, ResponseFormat):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StructuredError(f"'{where}' must be an object with a string 'type' (text, json_object or "
                              "json_schema)", where)
    kind = value["type"]
    extra = sorted(k for k in value if k not in ("type", "json_schema"))
    if extra:
        raise StructuredError(f"unsupported field(s) in '{where}': {', '.join(map(repr, extra))}", where)
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return json_object()
    if kind != JSON_SCHEMA:
        raise StructuredError(f"'{where}.type' must be text, json_object or json_schema, got {kind!r}",
                              f"{where}.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredError(f"'{where}.json_schema' must be an object with a 'schema'", f"{where}.json_schema")
    extra = sorted(k for k in spec if k not in ("name", "schema", "strict", "description"))
    if extra:
        raise StructuredError(f"unsupported field(s) in '{where}.json_schema': {', '.join(map(repr, extra))}",
                              f"{where}.json_schema")
    name = spec.get("name", "schema")
    if not isinstance(name, str) or not name:
        raise StructuredError(f"'{where}.json_schema.name' must be a non-empty string", f"{where}.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredError(f"'{where}.json_schema.strict' must be true or false", f"{where}.json_schema.strict")
    if "schema" not in spec:
        raise StructuredError(f"'{where}.json_schema' has no 'schema'", f"{where}.json_schema.schema")
    return json_schema(spec["schema"], name, strict, where)
