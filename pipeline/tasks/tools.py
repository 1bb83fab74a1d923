"""Tools a student may call in a multi-turn rollout: the call format, the registry, and running a call.

The student calls a tool by writing, anywhere in its turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 41"}}</tool_call>

the convention of common chat templates (Qwen, Hermes). :func:`parse_tool_call` reads the first such
call of a turn. :func:`run_tool_call` executes it and always returns a :class:`ToolResult` whose text
becomes the tool turn; nothing a tool or the student does can stop a rollout: a call with broken JSON,
an unknown tool, a tool that raises, returns something that is not text, a number or JSON data, or runs
past its time limit, each produces an ``error: ...`` text the student sees, and ``ok`` False.

Built-in tools, each ``tool(arguments: dict, row: dict) -> str`` (``row`` is the prompt's row):

* ``calculator``: ``{"expression": "..."}``; + - * / // % ** and parentheses over integers and decimals,
  evaluated exactly (fractions) without ``eval``; huge powers are refused;
* ``lookup``: ``{"key": "..."}``; the value of ``key`` in the prompt row's ``lookup`` mapping (a dict,
  or a JSON string holding one).

A user's own tool is named by import path, ``package.module:function``, with the same signature.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from gndpo.errors import first_line
from gndpo.pipeline.tasks.plugins import named_callable

Tool = Callable[[dict, dict], str]
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
MAX_RESULT_CHARS = 2000  # a tool turn longer than this is cut (the length budget is the rollout's)


@dataclass(frozen=True)
class ToolCall:
    """A call the student wrote: the tool's name and its arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolResult:
    """What a tool turn carries back to the student: the text, and whether the call succeeded."""

    name: str | None  # the tool called (None when the call could not be read)
    text: str  # what the tool turn says
    ok: bool


def parse_tool_call(text: str) -> ToolCall | str | None:
    """The first ``<tool_call>`` of ``text``: None when there is none, a :class:`ToolCall`, or a string
    saying why the call cannot be read."""
    match = CALL.search(text)
    if match is None:
        return None
    try:
        body = json.loads(match.group(1))
    except ValueError as exc:
        return f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        return 'the tool call needs {"name": "<tool>", "arguments": {...}}'
    arguments = body.get("arguments", {})
    if isinstance(arguments, str):  # some templates serialize the arguments a second time
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return "the tool call's arguments are not a JSON object"
    if not isinstance(arguments, dict):
        return "the tool call's arguments are not a JSON object"
    return ToolCall(body["name"], arguments)


# -- built-in tools -----------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 1000
MAX_DIGITS = 10_000


def _evaluate(node) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError("only integer powers up to 1000 are supported")
        result = _BINARY[type(node.op)](left, right)
        if len(str(result.numerator)) > MAX_DIGITS:
            raise ValueError("the result is too large")
        return result
    raise ValueError("only numbers, + - * / // % ** and parentheses are supported")


def calculator(arguments: dict, row: dict) -> str:
    """The exact value of ``arguments["expression"]``: an integer, or a decimal with up to 12 places."""
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ValueError('calculator needs {"expression": "<arithmetic>"}')
    try:
        value = _evaluate(ast.parse(expression, mode="eval"))
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


def lookup(arguments: dict, row: dict) -> str:
    """The value stored under ``arguments["key"]`` in the prompt row's ``lookup`` mapping."""
    key = arguments.get("key")
    if not isinstance(key, str):
        raise ValueError('lookup needs {"key": "<name>"}')
    table = row.get("lookup") or {}
    if isinstance(table, str):
        table = json.loads(table)
    if key not in table:
        raise KeyError(f"no entry {key!r}")
    return str(table[key])


TOOLS: dict[str, Tool] = {"calculator": calculator, "lookup": lookup}


def get_tool(name: str) -> Tool:
    """A built-in tool by name, or a user's by import path ``module:function``; a GndpoError otherwise."""
    return named_callable(name, TOOLS, "tool")


def _as_text(value) -> str:
    """A tool's return value as the tool turn's text; TypeError for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    raise TypeError(f"returned {type(value).__name__}, not text, a number or JSON data")


def _in_thread(tool: Tool, arguments: dict, row: dict) -> tuple[threading.Thread, dict]:
    """Start ``tool`` on a daemon thread (one that never returns costs that thread, never the rollout
    or the process's exit); the dict receives ``value`` or ``error`` when it finishes."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = tool(arguments, row)
        except BaseException as exc:  # anything the tool raises is the student's or the tool's problem
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="gndpo-tool")
    thread.start()
    return thread, outcome


def run_tool_calls(texts: list[str], tools: dict[str, Tool], rows: list[dict], timeout_s: float) -> list[ToolResult | None]:
    """Execute the first tool call in each of ``texts`` (with ``rows[i]`` as its prompt row) with
    ``tools`` (name -> function; only these may be called), all at once: each call runs on its own
    thread and has ``timeout_s`` from the moment they all start. Per text: None when it calls no tool;
    otherwise the result, ``error: ...`` on any failure."""
    results: list[ToolResult | None] = [None] * len(texts)
    running = []
    for i, (text, row) in enumerate(zip(texts, rows)):
        call = parse_tool_call(text)
        if call is None:
            continue
        if isinstance(call, str):
            results[i] = ToolResult(None, f"error: {call}", False)
        elif call.name not in tools:
            results[i] = ToolResult(call.name, f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}", False)
        else:
            running.append((i, call.name, *_in_thread(tools[call.name], call.arguments, row)))
    deadline = time.monotonic() + timeout_s
    for i, name, thread, outcome in running:
        thread.join(max(deadline - time.monotonic(), 0.0))
        results[i] = _result(name, outcome, timeout_s)
    return results


def _result(name: str, outcome: dict, timeout_s: float) -> ToolResult:
    if not outcome:
        return ToolResult(name, f"error: {name} did not answer within {timeout_s:g} s", False)
    if "error" in outcome:
        return ToolResult(name, f"error: {name}: {first_line(outcome['error'], with_type=True)}", False)
    try:
        text = _as_text(outcome["value"])
    except TypeError as exc:
        return ToolResult(name, f"error: {name}: {first_line(exc, with_type=True)}", False)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + " ...(cut)"
    return ToolResult(name, text, True)


def run_tool_call(text: str, tools: dict[str, Tool], row: dict, timeout_s: float) -> ToolResult | None:
    """:func:`run_tool_calls` for one text."""
    return run_tool_calls([text], tools, [row], timeout_s)[0]
