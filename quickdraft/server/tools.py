"""Tool calling for chat: the model's chat template renders the tools (OpenAI's function definitions), the
model writes calls in the Hermes format Qwen2.5's template asks for, `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>`, and the reply's calls are parsed into OpenAI's `tool_calls`.

tool_choice "auto" lets the model choose; "none" gives it no tools; "required" and a named function force a
call through structured outputs (a grammar of the call block with the function's parameters as a JSON
schema), so the call always parses, exactly under speculation like any constraint."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from quickdraft.server.protocol import ApiError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> list[dict] | None:
    """The tools the prompt gets (None: none), after checking both fields; raises ApiError naming the field."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    names = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):
            raise ApiError(400, 'each tool must be {"type": "function", "function": {"name": ..., "parameters": '
                                '{...}}}', "tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise ApiError(400, f"tool {function['name']!r}: parameters must be a JSON schema object", "tools")
        names.append(function["name"])
    if tool_choice is not None and tool_choice not in ("none", "auto", "required"):
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        if name not in names:
            raise ApiError(400, f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                                f"{{\"name\": ...}}}} naming one of the tools {names}", "tool_choice")
    return None if tool_choice == "none" else list(tools)


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_call_constraint(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None) -> dict | None:
    """The structured_outputs grammar that forces a call ("required": of any tool; a named function: of that
    one), or None when the model chooses."""
    if tool_choice == "required":
        functions = [tool["function"] for tool in tools]
    elif isinstance(tool_choice, dict):
        functions = [tool["function"] for tool in tools if tool["function"]["name"] == tool_choice["function"]["name"]]
    else:
        return None
    schema = _call_schema(functions[0]) if len(functions) == 1 else {"anyOf": [_call_schema(f) for f in functions]}
    # Compact separators: with free whitespace a weak model can pad a call until max_tokens cuts it.
    schema["x-guidance"] = {"whitespace_flexible": False}
    lark = f'start: "{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"\ncall: %json {json.dumps(schema)}'
    return {"grammar": lark}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the reply's text outside call blocks, or None when there is none; its calls as OpenAI tool_calls).
    A block that is not a JSON object with a name stays in the text."""
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def held_back(text: str) -> int:
    """Where a streamed reply's text must stop being sent: the start of a call block, or of a tail that could
    still become one (a prefix of "<tool_call>"); len(text) when nothing is held."""
    at = text.find(CALL_OPEN)
    if at >= 0:
        return at
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return len(text) - size
    return len(text)
