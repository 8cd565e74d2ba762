"""OpenAI-style chat messages -> the prompt string the model was trained on (SPEC.md §11).

The release has no chat template; its encoding package builds prompts as text with the protocol
tokens written out, and the tokenizer turns each protocol token into one id. Rules:

* the prompt starts with BOS, then the first message's text when it is a system message;
* user turns are `<｜User｜>{text}`, later system messages `<｜System｜>{text}`, tool results
  `<｜User｜><tool_result>{text}</tool_result>` (consecutive results share one user turn, joined by
  blank lines in the order of the calls they answer; a user message after them joins that turn);
* the request's `tools` follow the system prompt after a blank line as the release's tool block
  (`## Tools` ..., one JSON schema per line), and an assistant's `tool_calls` follow its reply as a
  DSML block (`\n\n<｜DSML｜ calls>` with one `<｜DSML｜ invoke name=…>` per call and one
  `<｜DSML｜ parameter name=… string="true|false">` per argument);
* assistant turns are `<｜Assistant｜>` + `<think>{reasoning}</think>` (in thinking mode: turns
  after the last user message, or every turn once tools are used) or `</think>` (reasoning
  dropped; kept in every turn when tools are given), then the reply and EOS;
* a conversation that does not end with an assistant turn ends with the generation prompt
  `<｜Assistant｜><think>` (thinking) or `<｜Assistant｜></think>` (chat);
* a reasoning effort is written only in thinking mode, at the start, as a `<｜System｜>` block
  that the system prompt follows after a blank line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dsv41.model.tokenizer import ASSISTANT, BOS, DSML, END_THINK, EOS, IMAGE, SYSTEM, THINK, USER

EFFORT_LEVELS = {"low": 50, "high": 75, "max": 100}
TOOL_RESULT, END_TOOL_RESULT = "<tool_result>", "</tool_result>"
CALLS, INVOKE, PARAMETER = f"<{DSML} calls>", f"<{DSML} invoke", f"<{DSML} parameter"
END_CALLS, END_INVOKE, END_PARAMETER = f"</{DSML} calls>", f"</{DSML} invoke>", f"</{DSML} parameter>"
TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{CALLS}" block like the following:

{CALLS}
{INVOKE} name="$TOOL_NAME">
{PARAMETER} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{END_PARAMETER}
...
{END_INVOKE}
{INVOKE} name="$TOOL_NAME2">
...
{END_INVOKE}
{END_CALLS}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside \
{THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{tool_schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The release's tool block for OpenAI-style `tools` (each {"type": "function", "function": {...}})."""
    schemas = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}")
        schemas.append(to_json(dict(function)))
    return TOOLS_TEMPLATE.replace("{tool_schemas}", "\n".join(schemas))


def call_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call's arguments as a dict (they arrive as a JSON string, or as an object)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError("each tool call must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                         "\"arguments\": ...}}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call {function['name']!r}: arguments are not JSON: {e}") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"tool call {function['name']!r}: arguments must be a JSON object")
    return dict(arguments)


def calls_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant's tool calls as the DSML block that follows its reply."""
    invokes = []
    for call in calls:
        params = [f'{PARAMETER} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
                  f'{value if isinstance(value, str) else to_json(value)}{END_PARAMETER}'
                  for key, value in call_arguments(call).items()]
        invokes.append(f'{INVOKE} name="{call["function"]["name"]}">\n' + "\n".join(params) + f"\n{END_INVOKE}")
    return f"\n\n{CALLS}\n" + "\n".join(invokes) + f"\n{END_CALLS}"


def effort_value(effort: int | str) -> int:
    """An effort as the 1..100 number written into the prompt."""
    if isinstance(effort, str) and effort in EFFORT_LEVELS:
        return EFFORT_LEVELS[effort]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise ValueError(f"reasoning_effort must be an integer 1-100 or one of {', '.join(EFFORT_LEVELS)}, "
                     f"got {effort!r}")


def effort_line(effort: int | str) -> str:
    return (f"Reasoning Effort: {effort_value(effort)} (range 1-100, the higher the value, "
            "the more thorough the reasoning)")


def content_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """A message's text: a string as is, content blocks joined by blank lines with one image token
    per image."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            parts.append(block["text"])
        elif kind in ("image", "image_url"):
            parts.append(IMAGE)
        else:
            raise ValueError(f"unknown content block type {kind!r}; expected text, image or image_url")
    return "\n\n".join(parts)


def _ordered_results(body: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Consecutive tool results in the order of the calls of the assistant turn before them (by
    tool_call_id; unknown ids first, as the release's stable sort puts them)."""
    out, order, i = [], {}, 0
    while i < len(body):
        message = body[i]
        if message.get("role") == "assistant" and message.get("tool_calls"):
            order = {call.get("id"): n for n, call in enumerate(message["tool_calls"]) if call.get("id")}
        if message.get("role") != "tool":
            out.append(message)
            i += 1
            continue
        j = i
        while j < len(body) and body[j].get("role") == "tool":
            j += 1
        out += sorted(body[i:j], key=lambda r: order.get(r.get("tool_call_id"), 0))
        i = j
    return out


def render(messages: Sequence[Mapping[str, Any]], thinking: bool = False,
           reasoning_effort: int | str | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The prompt string of `messages` in chat mode or thinking mode (an effort is checked in both),
    with the tool block of `tools` (OpenAI-style) after the system prompt."""
    effort = None if reasoning_effort is None else effort_line(reasoning_effort)
    body = list(messages)
    has_system = bool(body) and body[0].get("role") == "system"
    system = content_text(body.pop(0).get("content")) if has_system else ""
    if tools:
        system = system + "\n\n" + tools_text(tools)
    if thinking and effort is not None:
        system = SYSTEM + effort + ("\n\n" + system if system else "")
    body = _ordered_results(body)
    keep_all = bool(tools) or any(message.get("role") == "tool" for message in body)
    last_user = max((i for i, message in enumerate(body) if message.get("role") == "user"), default=-1)
    out, in_results = [BOS, system], False
    for i, message in enumerate(body):
        role, text = message.get("role"), content_text(message.get("content"))
        if role == "tool":
            out.append(("\n\n" if in_results else USER) + TOOL_RESULT + text + END_TOOL_RESULT)
        elif role == "user":
            out.append(("\n\n" if in_results else USER) + text)
        elif role == "system":
            out.append(SYSTEM + text)
        elif role == "assistant":
            keep = thinking and (keep_all or i > last_user)
            reasoning = THINK + (message.get("reasoning_content") or "") + END_THINK if keep else END_THINK
            calls = calls_text(message["tool_calls"]) if message.get("tool_calls") else ""
            out.append(ASSISTANT + reasoning + text + calls + EOS)
        else:
            raise ValueError(f"unknown role {role!r}; expected system, user, assistant or tool")
        in_results = role in ("tool", "user") and in_results or role == "tool"
    if not body or body[-1].get("role") != "assistant":
        out.append(ASSISTANT + (THINK if thinking else END_THINK))
    return "".join(out)
