"""Tool calling's request and response sides (`services/coordinator/tool_calls.py`): tools
and tool_choice checked naming the field, `required` and named choices turned into the
constraint that makes their arguments parse, each parser's format read into calls (and
text that is not a whole call left as content), a stream's content held back where a call
may begin, and tools rendered for a chat template that has no place for them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.prompts import template_takes_tools, with_tools_in_text
from pdserve.services.coordinator.tool_calls import ToolPlan, ToolStream, parse_text

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
         None, "tools[0].function.parameters"),
        (None, "required", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}},
         "tool_choice.function.name"),
        ([WEATHER], "sometimes", "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_and_choices_are_refused_naming_the_field(tools, choice, field):
    with pytest.raises(InvalidRequestError) as refused:
        ToolPlan.from_request(tools, choice, None, "hermes")
    assert refused.value.field == field


def test_required_and_named_choices_become_constraints():
    required = ToolPlan.from_request([WEATHER, TIME], "required", False, "hermes")
    schema = json.loads(required.constraint.json_schema)
    call = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):  # not parallel: one call at most
        jsonschema.validate(call * 2, schema)
    with pytest.raises(jsonschema.ValidationError):  # parameters held to the tool's schema
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    content, calls = required.parse(json.dumps(call))
    assert content is None and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    named = ToolPlan.from_request([WEATHER, TIME], {"type": "function",
                                                   "function": {"name": "get_weather"}},
                                  None, "hermes")  # fmt: skip
    assert json.loads(named.constraint.json_schema) == WEATHER["function"]["parameters"]
    assert named.parse('{"city": "Rome"}')[1][0]["function"]["name"] == "get_weather"
    assert ToolPlan.from_request([WEATHER], "none", None, "hermes").parse("hi") == ("hi", [])
    assert ToolPlan.from_request(None, None, None, "hermes") is None


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Oslo"}}\n</tool_call>', "Let me check.",
         [("get_weather", {"city": "Oslo"})]),
        ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>'
         '{"name": "b", "arguments": {"x": 1}}</tool_call>', None, [("a", {}), ("b", {"x": 1})]),
        ("hermes", "no call here", "no call here", []),
        ("hermes", "<tool_call>{broken", "<tool_call>{broken", []),
        ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"q": 2}}', None,
         [("a", {"q": 2})]),
        ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}',
         None, [("a", {}), ("b", {})]),
        ("mistral", 'ok [TOOL_CALLS] [{"name": "a", "arguments": {"z": true}}]', "ok",
         [("a", {"z": True})]),
    ],
)  # fmt: skip
def test_each_parser_reads_its_format(parser, text, content, calls):
    got_content, got = parse_text(text, parser)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


def test_a_stream_holds_back_what_may_begin_a_call():
    plan = ToolPlan.from_request([WEATHER], "auto", None, "hermes")
    stream = ToolStream(plan)
    sent = [stream.feed(d) for d in ["Sure", ", one moment <tool", "_call>\n{\"name\": ",
                                     '"get_weather", "arguments": {"city": "Oslo"}}',
                                     "\n</tool_call>"]]  # fmt: skip
    assert sent == ["Sure", ", one moment ", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    plain = ToolStream(plan)
    assert plain.feed("a <tool") == "a " and plain.feed("box> b") == "<toolbox> b"
    assert plain.finish() == ("", [])
    named = ToolStream(ToolPlan.from_request(
        [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, "hermes"
    ))  # fmt: skip
    assert named.feed('{"city": "Oslo"}') == ""
    assert named.finish()[1][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_tools_are_rendered_for_a_template_without_them():
    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    assert not template_takes_tools(Plain())
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]  # fmt: skip
    rendered = with_tools_in_text(messages, [WEATHER])
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_the_chat_request_carries_the_tools_and_the_choices_constraint():
    from pdserve.services.coordinator.openai_protocol import ChatCompletionRequest

    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        tools=[WEATHER, TIME], tool_choice="required", n=2,
    )  # fmt: skip
    plan = body.tool_plan()
    requests = body.to_generate_requests(plan)
    assert len(requests) == 2
    for request in requests:
        assert [t.name for t in request.tools] == ["get_weather", "get_time"]
        assert request.sampling.structured_output == plan.constraint
        assert request.messages[1].tool_calls[0].arguments == '{"city": "Oslo"}'
        assert request.messages[2].tool_call_id == "call_1"
    with pytest.raises(InvalidRequestError) as refused:  # two constraints at once
        ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice="required",
            response_format={"type": "json_object"},
        ).to_generate_requests(plan)  # fmt: skip
    assert refused.value.field == "tool_choice"
