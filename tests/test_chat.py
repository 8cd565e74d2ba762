"""Chat messages -> the release's prompt string (SPEC.md §11), and its ids under the small tokenizer."""

from __future__ import annotations

import json

import pytest

from dsv41.chat import render
from dsv41.model.tokenizer import encode, load_tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is 2+2?"}
README_EXAMPLE = ("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, "
                  "the more thorough the reasoning)\n\nYou are a helpful assistant.<｜User｜>What is 2+2?"
                  "<｜Assistant｜><think>")


def test_the_readme_example_and_its_protocol_ids():
    prompt = render([SYSTEM, USER], thinking=True, reasoning_effort="high")
    assert prompt == README_EXAMPLE
    tok = load_tokenizer("small", 4096)
    ids = encode(tok, prompt)
    assert ids[:2] == [0, 7] and ids[-2:] == [4, 5] and ids.count(3) == 1 and ids.count(0) == 1
    assert tok.encode(prompt, add_special_tokens=False).tokens[:2] == ["<｜begin▁of▁sentence｜>", "<｜System｜>"]
    assert [i for i in ids if i < 17] == [0, 7, 3, 4, 5]  # each protocol token is one id, none appear split
    assert tok.decode(ids, skip_special_tokens=False) == prompt


@pytest.mark.parametrize(("effort", "number"), [("low", 50), ("high", 75), ("max", 100), (1, 1), (100, 100), (33, 33)])
def test_reasoning_effort_values(effort, number):
    prompt = render([USER], thinking=True, reasoning_effort=effort)
    assert prompt.startswith(f"<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: {number} (range 1-100, the higher")
    assert prompt.endswith("the more thorough the reasoning)<｜User｜>What is 2+2?<｜Assistant｜><think>")


@pytest.mark.parametrize("effort", [0, 101, -5, True, 50.0, "medium", "HIGH", "75"])
def test_bad_reasoning_effort_is_refused_in_either_mode(effort):
    for thinking in (False, True):
        with pytest.raises(ValueError, match="reasoning_effort must be an integer 1-100"):
            render([USER], thinking=thinking, reasoning_effort=effort)


def test_chat_mode_ignores_effort_and_closes_thinking():
    assert render([SYSTEM, USER], reasoning_effort="max") == render([SYSTEM, USER]) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>")
    assert render([SYSTEM, USER], thinking=True) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>")
    assert render([USER]) == "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜></think>"


def test_earlier_reasoning_is_dropped_and_turns_end_with_eos():
    messages = [SYSTEM, USER, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"},
                {"role": "system", "content": "Answer in words."}, {"role": "user", "content": "And 3+3?"}]
    tail = ("<｜User｜>What is 2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜><｜System｜>Answer in words."
            "<｜User｜>And 3+3?")
    for thinking, end in ((True, "<think>"), (False, "</think>")):
        assert render(messages, thinking=thinking) == (
            f"<｜begin▁of▁sentence｜>You are a helpful assistant.{tail}<｜Assistant｜>{end}")
    done = [*messages, {"role": "assistant", "content": "six", "reasoning_content": "3+3=6"}]
    assert render(done, thinking=True).endswith(
        "<｜User｜>And 3+3?<｜Assistant｜><think>3+3=6</think>six<｜end▁of▁sentence｜>")
    assert render(done).endswith("<｜User｜>And 3+3?<｜Assistant｜></think>six<｜end▁of▁sentence｜>")


def test_tool_results_sit_in_a_user_turn_and_keep_reasoning():
    messages = [USER, {"role": "assistant", "content": "Let me check.", "reasoning_content": "use the tool"},
                {"role": "tool", "content": "4"}, {"role": "tool", "content": "four"}]
    assert render(messages, thinking=True) == (
        "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>use the tool</think>Let me check."
        "<｜end▁of▁sentence｜><｜User｜><tool_result>4</tool_result>\n\n<tool_result>four</tool_result>"
        "<｜Assistant｜><think>")


TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look up a value", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}


def test_tools_and_tool_calls_render_as_the_release_encodes_them():
    """The release encoder's multi-turn vector: reasoning kept with tools, DSML calls after the reply,
    results in the order of the calls (not of arrival) joined by blank lines."""
    calls = [{"id": cid, "type": "function", "function": {"name": "lookup", "arguments": {"query": q}}}
             for cid, q in (("a", "first"), ("b", "second"))]
    messages = [{"role": "system", "content": "system"}, {"role": "user", "content": "question"},
                {"role": "assistant", "reasoning_content": "reason", "content": "summary", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "second result"},
                {"role": "tool", "tool_call_id": "a", "content": "first result"}]
    prompt = render(messages, thinking=True, tools=[TOOL])
    assert prompt[prompt.index("<｜User｜>"):] == (
        "<｜User｜>question<｜Assistant｜><think>reason</think>summary\n\n"
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">first</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">second</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>first result</tool_result>\n\n"
        "<tool_result>second result</tool_result><｜Assistant｜><think>")
    head = prompt[:prompt.index("<｜User｜>")]
    assert head.startswith("<｜begin▁of▁sentence｜>system\n\n## Tools\n\nYou have access to a set of tools")
    assert '\n\n{"name": "lookup", "description": "Look up a value", "parameters": ' in head
    assert head.endswith("You MUST strictly follow the above defined tool name and parameter schemas to invoke "
                         "tool calls.\n")
    # arguments as a JSON string (what the OpenAI client sends back) render the same; non-strings as JSON
    as_text = [{**c, "function": {"name": "lookup", "arguments": json.dumps(c["function"]["arguments"])}}
               for c in calls]
    assert render([*messages[:2], {**messages[2], "tool_calls": as_text}, *messages[3:]], thinking=True,
                  tools=[TOOL]) == prompt
    numbers = [{"type": "function", "function": {"name": "f", "arguments": '{"n": 3, "xs": [1, "a"]}'}}]
    assert ('<｜DSML｜ parameter name="n" string="false">3</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="xs" string="false">[1, "a"]</｜DSML｜ parameter>') in render(
        [USER, {"role": "assistant", "content": "", "tool_calls": numbers}])
    for bad, why in (([{"type": "function"}], "each tool must be"), ([{"function": {"name": 3}}], "each tool")):
        with pytest.raises(ValueError, match=why):
            render([USER], tools=bad)
    with pytest.raises(ValueError, match="arguments are not JSON"):
        render([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_content_blocks_and_bad_input():
    blocks = [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": "x"}},
              {"type": "text", "text": "this picture?"}]
    assert render([{"role": "user", "content": blocks}]) == (
        "<｜begin▁of▁sentence｜><｜User｜>What is in\n\n<｜deepseek_image｜>\n\nthis picture?<｜Assistant｜></think>")
    with pytest.raises(ValueError, match="unknown role 'developer'"):
        render([{"role": "developer", "content": "x"}])
    with pytest.raises(ValueError, match="unknown content block type 'audio'"):
        render([{"role": "user", "content": [{"type": "audio"}]}])
