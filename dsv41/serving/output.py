"""Generated text -> OpenAI message parts: reasoning, content, tool calls, and stop strings.

Text arrives in pieces as tokens are generated. In thinking mode everything up to `</think>` is
reasoning; after it comes the reply. With tools, a `<｜DSML｜ calls>` block in the reply is parsed into
OpenAI `tool_calls` when the generation ends (a block that does not parse stays in the content, so
nothing the model wrote is lost). A stop string ends the reply before it. Text that could be the
start of a marker is held back until the next piece decides it, so streamed deltas never show a
partial `</think>`, DSML tag or stop string.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from dataclasses import dataclass, field

from dsv41.chat import CALLS, END_CALLS, END_INVOKE, END_PARAMETER, INVOKE, PARAMETER
from dsv41.model.tokenizer import END_THINK

_INVOKE = re.compile(re.escape(INVOKE) + r'\s+name="([^"]*)">(.*?)' + re.escape(END_INVOKE), re.DOTALL)
_PARAMETER = re.compile(re.escape(PARAMETER) + r'\s+name="([^"]*)"\s+string="(true|false)">(.*?)'
                        + re.escape(END_PARAMETER), re.DOTALL)


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def parse_tool_calls(block: str) -> list[dict]:
    """OpenAI tool calls from the text of a DSML calls block; [] when it holds none."""
    calls = []
    for name, body in _INVOKE.findall(block):
        arguments = {}
        for key, is_string, value in _PARAMETER.findall(body):
            if is_string == "false":
                with contextlib.suppress(json.JSONDecodeError):
                    value = json.loads(value)
            arguments[key] = value
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return calls


def _held(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class OutputParser:
    def __init__(self, thinking: bool = False, tools: bool = False, stop: list[str] | None = None):
        self.phase = "reasoning" if thinking else "content"
        self.tools, self.stop = tools, [s for s in stop or [] if s]
        self.pending = ""  # text not yet given out
        self.calls_text = ""  # the DSML block, once it started
        self.stopped = False  # a stop string was generated: the request ends here
        self.reasoning, self.content, self.tool_calls = [], [], []

    def _markers(self) -> list[str]:
        if self.phase == "reasoning":
            return [END_THINK]
        return [*self.stop, *([CALLS] if self.tools else [])]

    def push(self, text: str) -> Delta:
        """The parts of `text` that are decided now."""
        delta = Delta()
        if self.stopped:
            return delta
        if self.phase == "calls":
            self.calls_text += text
            return delta
        self.pending += text
        while True:
            if self.phase == "reasoning":
                at = self.pending.find(END_THINK)
                if at < 0:
                    break
                delta.reasoning += self.pending[:at]
                self.pending, self.phase = self.pending[at + len(END_THINK):], "content"
                continue
            found = [(self.pending.find(s), s) for s in self._markers()]
            found = [(at, s) for at, s in found if at >= 0]
            if not found:
                break
            at, marker = min(found)
            if marker == CALLS and marker not in self.stop:
                delta.content += self.pending[:at].rstrip()
                self.calls_text, self.pending, self.phase = self.pending[at:], "", "calls"
            else:
                delta.content += self.pending[:at]
                self.pending, self.stopped = "", True
            return self._keep(delta)
        keep = _held(self.pending, self._markers())
        if self.phase == "content" and self.tools:  # blank lines before a calls block are not content
            stripped = self.pending[: len(self.pending) - keep]
            keep += len(stripped) - len(stripped.rstrip())
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        if self.phase == "reasoning":
            delta.reasoning += out
        else:
            delta.content += out
        return self._keep(delta)

    def finish(self) -> Delta:
        """Everything left when the generation ends (tool calls included)."""
        delta = Delta()
        if not self.stopped:
            if self.phase == "reasoning":
                delta.reasoning = self.pending
            elif self.phase == "content":
                delta.content = self.pending
            else:
                calls = parse_tool_calls(self.calls_text)
                if calls and END_CALLS in self.calls_text:
                    delta.tool_calls = calls
                    delta.content = self.calls_text[self.calls_text.index(END_CALLS) + len(END_CALLS):].strip()
                else:
                    delta.content = ("\n\n" if self.content else "") + self.calls_text
        self.pending = ""
        return self._keep(delta)

    def _keep(self, delta: Delta) -> Delta:
        self.reasoning.append(delta.reasoning)
        self.content.append(delta.content)
        self.tool_calls += delta.tool_calls
        return delta
