"""What vLLM does to a chat request's tools and tool calls before its chat template sees them.

A template that renders ``tools | tojson`` or a call's ``arguments | tojson`` prints whatever
objects it is given, so kvgate must hand it the very objects vLLM does, or the prompt's tokens
differ from the first tool on (one tool measured 84 tokens in kvgate against vLLM's 89, and no
block after the tools could ever hit). vLLM 0.32 (``renderers/online_renderer.py``,
``renderers/chat_utils.py``):

- ``tools``: each is validated as ``ChatCompletionToolsParam`` and rendered as its
  ``model_dump()``: ``{"type", "function": {"name", "description", "parameters"[, "strict"]
  [, "defer_loading"]}[, "defer_loading"]}`` in that order, ``description`` and ``parameters``
  filled with ``null`` when absent, ``strict``/``defer_loading`` only when set, unknown fields
  dropped at both levels, a tool-level ``defer_loading`` copied into ``function`` when that has
  none.
- an assistant message's ``tool_calls``: an empty list is dropped; each call's
  ``function.arguments`` JSON string is parsed to an object (empty, malformed or non-object
  JSON becomes ``{}``).
"""

from __future__ import annotations

import json
from typing import Any

from tokenizer.errors import InvalidPrompt

def normalize_tool(tool: Any, where: str) -> dict[str, Any]:
    """One tool as vLLM's ``ChatCompletionToolsParam.model_dump()``; invalid tools are client errors."""
    if not isinstance(tool, dict):
        raise InvalidPrompt(f"{where} must be an object")
    if tool.get("type", "function") != "function":
        raise InvalidPrompt(f"{where}.type must be 'function'")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidPrompt(f"{where}.function.name is a required string")
    description, parameters = fn.get("description"), fn.get("parameters")
    if description is not None and not isinstance(description, str):
        raise InvalidPrompt(f"{where}.function.description must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidPrompt(f"{where}.function.parameters must be an object")
    function: dict[str, Any] = {"name": fn["name"], "description": description, "parameters": parameters}
    if fn.get("strict") is not None:
        function["strict"] = fn["strict"]
    defer = fn.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")
    if defer is not None:
        function["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": function}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidPrompt("'tools' must be an array")
    return [normalize_tool(t, f"'tools'[{i}]") for i, t in enumerate(tools)]


def _parsed_arguments(value: Any) -> Any:
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def normalize_tool_calls(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant message with its ``tool_calls`` as vLLM renders them (a copy if anything changes)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    copy = dict(message)
    if not calls:
        del copy["tool_calls"]
        return copy
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise InvalidPrompt(f"{where}.tool_calls[{i}] must be an object with a 'function' object")
        out.append({**call, "function": {**fn, "arguments": _parsed_arguments(fn.get("arguments"))}})
    copy["tool_calls"] = out
    return copy
