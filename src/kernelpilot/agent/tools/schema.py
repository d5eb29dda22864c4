"""Tool arguments: the JSON-schema subset the tools use, checked without dependencies before a tool runs, and the
base class of a tool whose arguments are checked and whose typed result is rendered for the model."""

from __future__ import annotations

import abc
import json
from typing import Any

from kernelpilot.agent import RecoverableError, ToolContext, ToolOutput, ToolResult
from kernelpilot.agent.observations import observe


def validate_arguments(tool_name: str, schema: dict[str, Any], args: Any) -> None:
    """Raise RecoverableError naming the first way `args` breaks `schema` (the JSON-schema subset our tools use)."""
    if not isinstance(args, dict):
        raise RecoverableError(f"{tool_name} takes a JSON object of arguments, not {_json_type(args)}.")
    _check_value(args, schema, tool_name, "")


def _check_value(value: Any, schema: dict[str, Any], tool_name: str, where: str) -> None:
    expected = schema.get("type")
    if expected and not _has_json_type(value, expected):
        raise RecoverableError(f"{tool_name}: {_argument(where)} must be {_a(expected)}, not {_json_type(value)}.")
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(json.dumps(option) for option in schema["enum"])
        raise RecoverableError(f"{tool_name}: {_argument(where)} must be one of {allowed}, not {json.dumps(value)}.")
    if expected == "object":
        _check_object(value, schema, tool_name, where)
    elif expected == "array":
        if len(value) < schema.get("minItems", 0):
            raise RecoverableError(f"{tool_name}: {_argument(where)} needs at least {schema['minItems']} item(s).")
        for index, item in enumerate(value):
            _check_value(item, schema.get("items", {}), tool_name, f"{where}[{index}]")
    elif expected == "string" and len(value) < schema.get("minLength", 0):
        raise RecoverableError(f"{tool_name}: {_argument(where)} must not be empty.")
    elif expected in ("integer", "number"):
        low, high, above = schema.get("minimum"), schema.get("maximum"), schema.get("exclusiveMinimum")
        if above is not None and value <= above:
            raise RecoverableError(f"{tool_name}: {_argument(where)} must be more than {above}, not {value}.")
        if low is not None and value < low:
            raise RecoverableError(f"{tool_name}: {_argument(where)} must be at least {low}, not {value}.")
        if high is not None and value > high:
            raise RecoverableError(f"{tool_name}: {_argument(where)} must be at most {high}, not {value}.")


def _check_object(value: dict[str, Any], schema: dict[str, Any], tool_name: str, where: str) -> None:
    properties = schema.get("properties", {})
    prefix = f"{where}." if where else ""
    for name in schema.get("required", []):
        if name not in value:
            raise RecoverableError(f"{tool_name}: the argument `{prefix}{name}` is required.")
    unknown = [name for name in value if name not in properties]
    if unknown and schema.get("additionalProperties") is False:
        takes = ", ".join(properties) or "no arguments"
        raise RecoverableError(f"{tool_name}: unknown argument `{prefix}{unknown[0]}`; it takes: {takes}.")
    for name, item in value.items():
        if name in properties:
            _check_value(item, properties[name], tool_name, f"{prefix}{name}")


def _has_json_type(value: Any, expected: str) -> bool:
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a number
    return _json_type(value) == expected or (expected == "number" and _json_type(value) == "integer")


def _json_type(value: Any) -> str:
    for python_type, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                              (list, "array"), (dict, "object")):  # fmt: skip
        if isinstance(value, python_type):
            return name
    return "null" if value is None else type(value).__name__


def _argument(where: str) -> str:
    return f"`{where}`" if where else "the arguments"


def _a(type_name: str) -> str:
    return f"an {type_name}" if type_name[0] in "aeiou" else f"a {type_name}"


def object_schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or [], "additionalProperties": False}


class CheckedTool(abc.ABC):
    """A tool whose arguments are checked against its schema before `execute` runs, and whose typed result becomes
    the model's text in `agent/observations.py`."""

    name: str
    description: str
    parameters: dict[str, Any]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        validate_arguments(self.name, self.parameters, args)
        return observe(self.execute(args, ctx))

    @abc.abstractmethod
    def execute(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Do the tool's work with arguments that match its schema; return its typed result."""
