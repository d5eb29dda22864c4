"""The plain-text action format, for models without native tool calling: the instructions that teach it, the
parser that reads `<tool_call>{...}</tool_call>` (and fenced JSON) back into tool calls, and the conversion of a
native conversation into that form."""

from __future__ import annotations

import ast
import functools
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from kernelpilot.agent import RecoverableError, ToolCall
from kernelpilot.resources import data_dir

Message = dict[str, Any]

TEXT_ACTIONS_TEMPLATE = "text_actions.md"
TEXT_CALL_FORMAT = (
    'Write each call as <tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>, '
    "with the arguments as one JSON object."
)


_TAGGED_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.S)
_FENCED_BLOCK = re.compile(r"```[\w+-]*[ \t]*\n?(.*?)```", re.S)
_EMPTY_FENCE = re.compile(r"```[\w+-]*\s*```")
_LOOKS_LIKE_CALL = re.compile(r"""\A\s*\{\s*["']name["']\s*:""")
LENIENT_JSON = json.JSONDecoder(strict=False)  # models write raw newlines inside strings (file contents)
_JSON_LITERALS = {"true": True, "false": False, "null": None}


def text_tool_instructions(tools: Sequence[Any]) -> str:
    """How to call `tools` (OpenAI function schemas or Tool objects) in plain text; appended to the system prompt."""
    functions = [tool.get("function", tool) if isinstance(tool, dict) else tool for tool in tools]
    return _prompt_environment().get_template(TEXT_ACTIONS_TEMPLATE).render(tools=functions).strip()


@functools.lru_cache(maxsize=1)
def _prompt_environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(data_dir("prompts")), undefined=jinja2.StrictUndefined, autoescape=False
    )


def parse_text_actions(text: str) -> list[ToolCall]:
    """The tool calls written in `text` ([] when it has none); RecoverableError when one cannot be read."""
    return split_text_reply(text)[1]


def split_text_reply(text: str) -> tuple[str, list[ToolCall]]:
    """`text` as (prose without the calls, the calls). Calls are <tool_call> blocks, or, when there are none,
    fenced JSON objects that start with a "name" key."""
    blocks = [(m.span(), m.group(1)) for m in _TAGGED_CALL.finditer(text)]
    if not blocks:
        blocks = [(m.span(), m.group(1)) for m in _FENCED_BLOCK.finditer(text) if _LOOKS_LIKE_CALL.match(m.group(1))]
    calls = [_parse_call(body, number) for number, (_, body) in enumerate(blocks, start=1)]
    prose, end = [], 0
    for (start, stop), _ in blocks:
        prose.append(text[end:start])
        end = stop
    prose.append(text[end:])
    return _EMPTY_FENCE.sub("", "".join(prose)).strip(), calls


def _parse_call(body: str, number: int) -> ToolCall:
    fenced = _FENCED_BLOCK.search(body)
    if fenced:
        body = fenced.group(1)
    start = body.find("{")
    if start == -1:
        raise RecoverableError(f"Tool call {number} holds no JSON object. {TEXT_CALL_FORMAT}")
    call = _load_object(body[start:], number)
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise RecoverableError(f'Tool call {number} has no "name" naming the tool. {TEXT_CALL_FORMAT}')
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _load_object(arguments, number) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise RecoverableError(
            f'The "arguments" of tool call {number} ({name}) are a {type(arguments).__name__}, not an object. '
            f"{TEXT_CALL_FORMAT}"
        )
    return ToolCall(id=new_call_id(), name=name, arguments=arguments, raw_arguments=json.dumps(arguments))


def _load_object(text: str, number: int) -> dict[str, Any]:
    """The JSON object at the start of `text` (trailing prose ignored), or a Python-style dict (single quotes)."""
    try:
        value, _ = LENIENT_JSON.raw_decode(text)
    except json.JSONDecodeError as err:
        value = _python_literal(text[: text.rfind("}") + 1])
        if value is None:
            raise RecoverableError(
                f"Tool call {number} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}. "
                f"{TEXT_CALL_FORMAT}"
            ) from None
    if not isinstance(value, dict):
        raise RecoverableError(
            f"Tool call {number} is a JSON {type(value).__name__}, not an object. {TEXT_CALL_FORMAT}"
        )
    return value


class _JsonLiterals(ast.NodeTransformer):
    """Read true/false/null as Python literals, so a dict written with single quotes and JSON words still parses."""

    def visit_Name(self, node: ast.Name) -> ast.AST:  # noqa: N802 - ast's naming
        if node.id in _JSON_LITERALS:
            return ast.copy_location(ast.Constant(_JSON_LITERALS[node.id]), node)
        return node


def _python_literal(text: str) -> dict[str, Any] | None:
    try:
        value = ast.literal_eval(_JsonLiterals().visit(ast.parse(text, mode="eval")))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:16]}"


def as_text_conversation(messages: Sequence[Message], tools: Sequence[Any]) -> list[Message]:
    """The conversation for a model without native tool calling: tool instructions in the system message, its
    own earlier calls written back in the text format, and tool results as user messages."""
    converted: list[Message] = []
    tool_names: dict[str, str] = {}
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            tool_names.update({c["id"]: c["function"]["name"] for c in message["tool_calls"]})
            calls = [_format_call(c["function"]) for c in message["tool_calls"]]
            text = "\n\n".join([message.get("content") or "", *calls]).strip()
            converted.append({"role": "assistant", "content": text})
        elif role == "tool":
            name = message.get("name") or tool_names.get(message.get("tool_call_id", ""), "the tool")
            _append_user_text(converted, f"Result of {name}:\n{message.get('content') or ''}")
        elif role == "user" and isinstance(message.get("content"), str):
            _append_user_text(converted, message["content"])
        else:
            converted.append(dict(message))
    return _with_system_text(converted, text_tool_instructions(tools))


def _format_call(function: dict[str, Any]) -> str:
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = LENIENT_JSON.decode(arguments)
        except json.JSONDecodeError:
            pass  # shown as the model wrote it
    return f"<tool_call>\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n</tool_call>"


def _append_user_text(converted: list[Message], text: str) -> None:
    """Merge consecutive user messages: several chat templates require user and assistant to alternate."""
    if converted and converted[-1].get("role") == "user" and isinstance(converted[-1].get("content"), str):
        converted[-1] = {"role": "user", "content": f"{converted[-1]['content']}\n\n{text}"}
    else:
        converted.append({"role": "user", "content": text})


def _with_system_text(messages: list[Message], text: str) -> list[Message]:
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
