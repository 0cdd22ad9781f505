"""Tool-call parsers: hermes, the forced formats of tool_choice required/named, and a
third-party parser found through the entry-point group `rollout.tool_parsers`."""

import json
import sys

import jsonschema
import pytest

from rollout import InvalidRequestError, Tool
from rollout.apps.tool_parsers import available_tool_parsers, forced, load_tool_parser

ADD = Tool("add", "add two numbers", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})


def call(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


@pytest.fixture
def hermes():
    return load_tool_parser("hermes")


def test_hermes_finds_every_call_and_keeps_the_rest_as_content(hermes):
    text = ("let me add " + call('{"name": "add", "arguments": {"a": 1, "b": 2}}')
            + call('{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}'))
    parsed = hermes.parse(text, [ADD])
    assert parsed.ok and parsed.content == "let me add"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_plain_text_is_content(hermes):
    parsed = hermes.parse("no call here", [ADD])
    assert parsed.ok and parsed.content == "no call here" and parsed.tool_calls == ()


@pytest.mark.parametrize(("body", "reason"), [
    (call('{"name": "add", "arguments": {'), "not valid JSON"),
    (call('{"name": "sub", "arguments": {}}'), "unknown tool 'sub'"),
    (call('{"arguments": {}}'), 'not an object with a "name"'),
    (call('{"name": "add", "arguments": [1]}'), "arguments is not an object"),
    ('<tool_call>{"name": "add", "arguments": {}}', "never closed"),
])
def test_what_looks_like_a_call_but_is_not_is_an_error(hermes, body, reason):
    parsed = hermes.parse("answer: " + body, [ADD])
    assert not parsed.ok and parsed.tool_calls == ()
    (error,) = parsed.errors
    assert reason in error.reason and error.text == body


def hermes_grammar_accepts(hermes, tools, held, choice, parallel):
    """Whether the grammar of hermes' call constraint accepts a text."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from rollout.kit.structured import structural_tag_grammar

    grammar = xgrammar.Grammar.from_ebnf(structural_tag_grammar(
        hermes.constraint(tools, held, choice, parallel)))
    return lambda text: _is_grammar_accept_string(grammar, text)


SUB = Tool("sub", parameters={"type": "object", "properties": {"x": {"type": "string"}}})


def test_hermes_forces_required_calls_in_its_own_format(hermes):
    accepts = hermes_grammar_accepts(hermes, [ADD, SUB], [True, True], "required", True)
    one = '<tool_call>\n{"name": "add", "arguments": {"a":1,"b":2}}\n</tool_call>'
    two = one + '<tool_call>{"name": "sub", "arguments": {"x":"y"}}</tool_call>'
    assert accepts(one) and accepts(two)
    assert not accepts("")  # at least one call
    assert not accepts("sure " + one)  # nothing but calls
    assert not accepts('[{"name": "add", "parameters": {"a":1,"b":2}}]')
    assert not accepts(one.replace('"b":2', '"b":"2"'))  # held to the schema
    parsed = hermes.parse(two, [ADD, SUB])
    assert parsed.ok and parsed.content == "" and [c.name for c in parsed.tool_calls] == [
        "add", "sub"]
    assert not hermes_grammar_accepts(hermes, [ADD, SUB], [True, True], "required",
                                      False)(two)  # one call without parallel calls


def test_hermes_named_and_auto_constraints(hermes):
    named = hermes_grammar_accepts(hermes, [SUB], [False], "named", True)
    sub = '<tool_call>{"name": "sub", "arguments": [1]}</tool_call>'
    assert named(sub)  # arguments not held: any JSON
    assert not named(sub + sub)  # one call
    auto = hermes_grammar_accepts(hermes, [ADD], [True], "auto", True)
    call_ = '<tool_call>{"name": "add", "arguments": {"a":1,"b":2}}</tool_call>'
    assert auto("free text") and auto("sure: " + call_ + " and " + call_)
    assert not auto('sure: <tool_call>{"name": "add", "arguments": {"a":1}}</tool_call>')


def test_required_constraint_and_its_parse():
    schema = forced.required_constraint([ADD], parallel=False).json
    text = json.dumps([{"name": "add", "parameters": {"a": 1, "b": 2}}])
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(jsonschema.ValidationError):  # one call at most without parallel calls
        jsonschema.validate(json.loads(text) * 2, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"a": "x", "b": 2}}], schema)
    parsed = forced.parse_required(text, [ADD])
    assert parsed.ok and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("add", {"a": 1, "b": 2})]
    assert not forced.parse_required('[{"name": "add", "param', [ADD]).ok  # cut short


def test_named_constraint_is_the_tools_arguments():
    assert forced.named_constraint(ADD).json == ADD.parameters
    (made,) = forced.parse_named('{"a": 1, "b": 2}', ADD).tool_calls
    assert made.name == "add" and json.loads(made.arguments) == {"a": 1, "b": 2}
    assert not forced.parse_named("[1]", ADD).ok


def test_an_unknown_parser_names_the_installed_ones():
    with pytest.raises(InvalidRequestError) as info:
        load_tool_parser("mystery")
    assert info.value.field == "tool_call_parser" and "hermes" in info.value.allowed


def test_a_parser_is_looked_up_once_a_process_not_per_request(monkeypatch):
    """Every request with tools asks for its parser: the entry points, whose scan reads
    every installed distribution's metadata, are scanned for a name once (issue 50). An
    unknown name is looked for again: it may be installed later."""
    from rollout.contract import plugins

    load_tool_parser("hermes")
    scans, scan = [], plugins.installed
    monkeypatch.setattr(plugins, "installed", lambda group: scans.append(group) or scan(group))
    for _ in range(3):
        assert load_tool_parser("hermes").parse("hi", [ADD]).content == "hi"
    assert scans == []
    with pytest.raises(InvalidRequestError):
        load_tool_parser("mystery")
    assert scans == ["rollout.tool_parsers"]


PIPE_PARSER = '''
from rollout.apps.tool_parsers import ParsedMessage, make_call


class PipeParser:
    """name|json-arguments, one call per line starting with CALL "."""

    def parse(self, text, tools):
        lines = text.splitlines()
        calls = [make_call({"name": l[5:].split("|")[0], "arguments": l.split("|", 1)[1]},
                           tools) for l in lines if l.startswith("CALL ")]
        rest = "\\n".join(l for l in lines if not l.startswith("CALL "))
        return ParsedMessage(rest, tuple(calls))
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    info = tmp_path / "fake_parsers-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-parsers\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rollout.tool_parsers]\npipe = fake_pipe:PipeParser\n")
    (tmp_path / "fake_pipe.py").write_text(PIPE_PARSER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("fake_pipe", None)


def test_a_third_party_parser_is_found_and_used(site):
    assert {"hermes", "pipe"} <= set(available_tool_parsers())
    parsed = load_tool_parser("pipe").parse('hi\nCALL add|{"a": 1, "b": 2}', [ADD])
    assert parsed.content == "hi" and parsed.tool_calls[0].name == "add"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_take_the_parsers_format_or_json_without_one(site, choice):
    from rollout.apps.serving.openai_api import ToolUse

    body = {"tools": [ADD.as_openai()], "tool_choice": choice}
    tag = ToolUse(body, "hermes", constrained=False).constraint["structural_tag"]
    assert tag["format"]["type"] == "tags_with_separator"
    assert tag["format"]["tags"][0]["begin"].startswith("<tool_call>")
    schema = ToolUse(body, "pipe", constrained=False).constraint["json"]  # `forced`'s JSON
    call = {"a": 1, "b": 2}
    jsonschema.validate([{"name": "add", "parameters": call}] if choice == "required"
                        else call, schema)


@pytest.mark.parametrize("text", ["<tool_", '<tool_call>\n{"name": "a'])
def test_a_forced_answer_cut_before_its_first_call_is_text_with_the_reason(text):
    from rollout import Result
    from rollout.apps.serving.openai_api import ToolUse

    use = ToolUse({"tools": [ADD.as_openai()], "tool_choice": "required"}, "hermes", False)
    message, finish = use.message(Result("r", 0, (1,), text, "length", 3))
    assert finish == "length" and "tool_calls" not in message
    (error,) = message["tool_call_errors"]
    assert message["content"] == error["text"] == text and error["reason"]


def test_a_closing_tag_inside_a_string_does_not_end_the_call(hermes):
    """The grammar lets a JSON string hold `</tool_call>`: the call's JSON is read whole."""
    body = '{"name": "add", "arguments": {"a": 1, "b": 2, "note": "x</tool_call>y"}}'
    parsed = hermes.parse("<tool_call>" + body + "</tool_call>", None)
    assert parsed.ok and json.loads(parsed.tool_calls[0].arguments)["note"] == "x</tool_call>y"
    assert parsed.content == ""
