"""Tool calling in the Qwen family's format: the model writes ``<tool_call>\\n{"name": …, "arguments":
{…}}\\n</tool_call>`` blocks; clients get OpenAI ``tool_calls``.

- ``ToolCallParser`` reads the answer's text as it streams: text outside the blocks is content (a
  possible start of ``<tool_call>`` is held until decided), each complete block becomes one tool call
  (name and arguments in one delta). A block that is not valid JSON with a name stays content.
- ``tool_constraint``: ``tool_choice`` "required" or a named function is enforced with the structured-
  output grammar: the answer must be one such block whose JSON matches the function's parameters.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from services.frontend.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from shared.messages.sampling import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolCallParser:
    def __init__(self):
        self._buffer = ""  # text not yet decided: a possible opening tag, or a block in progress
        self._in_call = False
        self.calls: list[ParsedCall] = []

    def push(self, text: str) -> tuple[str, list[ParsedCall]]:
        """More answer text → (content to release, tool calls completed)."""
        self._buffer += text
        content, done = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._in_call = False
                call = self._parse(block)
                if call is None:
                    content.append(OPEN + block + CLOSE)
                else:
                    done.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buffer, OPEN)
            content.append(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return "".join(content), done

    def finish(self) -> str:
        """The rest once the answer ended: an unfinished block is content, as written."""
        rest = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return rest

    def _parse(self, block: str) -> ParsedCall | None:
        try:
            data = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        call = ParsedCall(len(self.calls), call_id(), data["name"],
                          arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
        self.calls.append(call)
        return call


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def tool_constraint(request: ChatCompletionRequest) -> Constraint | None:
    """The grammar that makes the answer a call: of the named function, or (required) of any tool."""
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in request.tools if t.function.name == choice.function.name]
    elif choice == "required":
        tools = list(request.tools)
    else:
        return None
    schema = {"anyOf": [_call_schema(tool) for tool in tools]} if len(tools) > 1 else _call_schema(tools[0])
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON, as the template writes calls
    lark = f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}\n'
    return Constraint("lark", lark)


def _call_schema(tool: Tool) -> dict:
    parameters = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
