"""OpenAI-style chat messages -> the prompt string the model was trained on (SPEC.md §11).

The release has no chat template; its encoding package builds prompts as text with the protocol
tokens written out, and the tokenizer turns each protocol token into one id. Rules:

* the prompt starts with BOS, then the first message's text when it is a system message;
* user turns are `<｜User｜>{text}`, later system messages `<｜System｜>{text}`, tool results
  `<｜User｜><tool_result>{text}</tool_result>` (consecutive results share one user turn);
* assistant turns are `<｜Assistant｜>` + `<think>{reasoning}</think>` (in thinking mode: turns
  after the last user message, or every turn once tools are used) or `</think>` (reasoning
  dropped), then the reply and EOS;
* a conversation that does not end with an assistant turn ends with the generation prompt
  `<｜Assistant｜><think>` (thinking) or `<｜Assistant｜></think>` (chat);
* a reasoning effort is written only in thinking mode, at the start, as a `<｜System｜>` block
  that the system prompt follows after a blank line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsv41.model.tokenizer import ASSISTANT, BOS, END_THINK, EOS, IMAGE, SYSTEM, THINK, USER

EFFORT_LEVELS = {"low": 50, "high": 75, "max": 100}
TOOL_RESULT, END_TOOL_RESULT = "<tool_result>", "</tool_result>"


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


def render(messages: Sequence[Mapping[str, Any]], thinking: bool = False,
           reasoning_effort: int | str | None = None) -> str:
    """The prompt string of `messages` in chat mode or thinking mode (an effort is checked in both)."""
    effort = None if reasoning_effort is None else effort_line(reasoning_effort)
    body = list(messages)
    system = content_text(body.pop(0).get("content")) if body and body[0].get("role") == "system" else ""
    if thinking and effort is not None:
        system = SYSTEM + effort + ("\n\n" + system if system else "")
    uses_tools = any(message.get("role") == "tool" for message in body)
    last_user = max((i for i, message in enumerate(body) if message.get("role") == "user"), default=-1)
    out, in_results = [BOS, system], False
    for i, message in enumerate(body):
        role, text = message.get("role"), content_text(message.get("content"))
        if role == "tool":
            out.append(("" if in_results else USER) + TOOL_RESULT + text + END_TOOL_RESULT)
        elif role == "user":
            out.append(USER + text)
        elif role == "system":
            out.append(SYSTEM + text)
        elif role == "assistant":
            if message.get("tool_calls"):
                raise ValueError("assistant tool calls (DSML blocks) are not rendered yet")
            keep = thinking and (uses_tools or i > last_user)
            reasoning = THINK + (message.get("reasoning_content") or "") + END_THINK if keep else END_THINK
            out.append(ASSISTANT + reasoning + text + EOS)
        else:
            raise ValueError(f"unknown role {role!r}; expected system, user, assistant or tool")
        in_results = role == "tool"
    if not body or body[-1].get("role") != "assistant":
        out.append(ASSISTANT + (THINK if thinking else END_THINK))
    return "".join(out)
