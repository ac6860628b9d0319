"""Constrained decoding through the Python API: SamplingParams(json_schema=..., regex=..., grammar=...) on the real
model and the demo model, mixed with free requests, under preemption; the tool-call grammar and its parsing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from llguidance import LLMatcher

from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.openai.tool_calls import CallStream, ToolUse

# nesting, enums, arrays with bounds, integers with bounds, an optional field. The scores are integers: a sampled
# reply may draw digits of a JSON number without end (any length is valid), and so run out of tokens by chance
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Other"]},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 10},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
        "nickname": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city", "scores", "address"],
    "additionalProperties": False,
}
PEOPLE = ("Alice", "Bob", "Chen", "Dana", "Emil", "Fatima", "Gus", "Hana")
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ADD = {
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}


def conversation(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe a person named {name} as JSON."}]


@pytest.fixture(scope="module")
def real(smollm2_gguf: Path):
    with LLM(smollm2_gguf, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8)) as llm:
        yield llm


@pytest.mark.slow
def test_replies_validate_against_their_schema_greedy_and_sampled(real: LLM) -> None:
    params = [
        SamplingParams(max_new_tokens=200, json_schema=SCHEMA, **({"temperature": 0.7, "seed": i} if i % 2 else {}))
        for i in range(len(PEOPLE))
    ]
    replies = real.chat([conversation(n) for n in PEOPLE], params)
    for reply in replies:
        assert reply.finish_reason == "stop", reply.text
        jsonschema.validate(json.loads(reply.text), SCHEMA)
    assert real.core.grammars.masks >= sum(len(r.token_ids) for r in replies) - len(replies)


@pytest.mark.slow
def test_regex_and_grammar_hold_the_reply(real: LLM) -> None:
    phone, answer = real.chat(
        [conversation("Alice"), [{"role": "user", "content": "Is Paris in France?"}]],
        [
            SamplingParams(max_new_tokens=20, regex=r"\+33 [0-9]{3} [0-9]{3} [0-9]{3}"),
            SamplingParams(grammar='start: "yes" | "no"'),
        ],
    )
    assert re.fullmatch(r"\+33 [0-9]{3} [0-9]{3} [0-9]{3}", phone.text) and phone.finish_reason == "stop"
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop"


@pytest.mark.slow
def test_free_requests_beside_constrained_ones_are_unchanged(real: LLM) -> None:
    free = SamplingParams(max_new_tokens=24)
    alone = real.chat([conversation("Bob")], free)[0]
    masks = real.core.grammars.masks
    real.chat([conversation("Bob")], free)
    assert real.core.grammars.masks == masks  # no constrained request, no mask computed
    mixed = real.chat([conversation("Bob"), conversation("Chen")], [free, SamplingParams(json_schema=SCHEMA)])
    assert mixed[0].token_ids == alone.token_ids
    assert real.core.grammars.masks > masks


@pytest.mark.slow
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(real: LLM) -> None:
    cases = [
        ({"json_schema": {"type": "objectx"}}, "json_schema: Invalid type: objectx"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"regex": "[a-"}, "regex:"),
        ({"grammar": "start: nothing_defined"}, "grammar:"),
    ]
    for fields, message in cases:
        with pytest.raises(OffloadError, match=re.escape(message)):
            real.chat([conversation("Dana")], SamplingParams(**fields))
    with pytest.raises(OffloadError, match="at most one of json_schema, regex and grammar"):
        SamplingParams(json_schema=SCHEMA, regex="a")
    assert real.core.num_running == real.core.num_waiting == 0  # nothing was queued


@pytest.mark.slow
def test_preempted_constrained_replies_stay_valid(smollm2_gguf: Path) -> None:
    """A KV cache of 4 MiB (about 180 tokens of this model) for 6 replies of about 60-100 tokens each: sequences are
    preempted and recomputed mid-reply, and every reply still validates."""
    config = EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=6, prefix_cache=False)
    with LLM(smollm2_gguf, config) as llm:
        replies = llm.chat(
            [conversation(n) for n in PEOPLE[:6]], SamplingParams(max_new_tokens=200, json_schema=SCHEMA)
        )
        assert llm.last_run.preemptions > 0
    for reply in replies:
        jsonschema.validate(json.loads(reply.text), SCHEMA)


def test_the_demo_model_replies_in_its_schema(demo_model: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    }
    schema |= {"required": ["ok", "n"], "additionalProperties": False}
    with LLM(demo_model, EngineConfig(kv_cache_bytes=16 << 20)) as llm:
        replies = llm.generate(
            ["The scheduler decides", "Batching is"], SamplingParams(max_new_tokens=40, json_schema=schema)
        )
    for reply in replies:
        assert reply.finish_reason == "stop"
        jsonschema.validate(json.loads(reply.text), schema)


def test_a_model_without_a_tokenizer_refuses_a_constraint(tmp_path: Path, tiny_llama: Path) -> None:
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for f in tiny_llama.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (model / f.name).symlink_to(f)
    with (
        LLM(model, EngineConfig(kv_cache_bytes=4 << 20)) as llm,
        pytest.raises(OffloadError, match="constrained decoding needs a tokenizer"),
    ):
        llm.generate_ids([[1, 5, 6]], SamplingParams(regex="[a-z]+"))


# ---- the tool-call grammar and its parsing (no model: the demo model's tokenizer) ------------------------------


@pytest.fixture(scope="module")
def matcher_for(demo_model: Path):
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    llt = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(grammar: str, text: str) -> bool:
        m = LLMatcher(llt, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    return accepts


CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'


def test_auto_takes_text_or_valid_calls_and_nothing_between(matcher_for) -> None:
    grammar = ToolUse((WEATHER, ADD), "auto").grammar()
    assert matcher_for(grammar, "It is sunny.")
    assert matcher_for(grammar, CALL)
    assert matcher_for(grammar, "Let me look. " + CALL)
    assert matcher_for(grammar, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert not matcher_for(grammar, "<tool_call>the weather</tool_call>")  # once opened, a block must be calls
    assert not matcher_for(grammar, '<tool_call>[{"name": "nope", "arguments": {}}]</tool_call>')
    assert not matcher_for(grammar, '<tool_call>[{"name": "add", "arguments": {"a": "one", "b": 2}}]</tool_call>')


def test_required_and_named_choices_take_calls_only(matcher_for) -> None:
    required = ToolUse((WEATHER, ADD), "required").grammar()
    assert matcher_for(required, CALL) and not matcher_for(required, "It is sunny.")
    named = ToolUse((WEATHER, ADD), "add").grammar()
    assert matcher_for(named, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert not matcher_for(named, CALL)
    single = ToolUse((WEATHER, ADD), "required", parallel=False).grammar()
    two = '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]'
    assert matcher_for(required, two + "</tool_call>") and not matcher_for(single, two + "</tool_call>")


def test_auto_with_a_response_format_takes_the_schema_or_calls(matcher_for) -> None:
    grammar = ToolUse((WEATHER,), "auto").grammar(
        json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})
    )
    assert matcher_for(grammar, '{"x": 1}') and matcher_for(grammar, CALL)
    assert not matcher_for(grammar, "plain text")


def test_replies_parse_into_openai_tool_calls() -> None:
    tools = ToolUse((WEATHER, ADD), "auto")
    content, calls = tools.parse("Let me check. " + CALL)
    assert content == "Let me check."
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    both = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n' + CALL
    assert [c["function"]["name"] for c in tools.parse(both)[1]] == ["add", "get_weather"]
    cut = '<tool_call>[{"name": "get_weather", "arguments": {"ci'
    assert tools.parse(cut) == (cut, [])  # cut by a length limit: all content, no calls
    assert tools.parse("plain") == ("plain", [])


def test_a_streamed_reply_holds_back_what_may_open_a_call() -> None:
    stream = CallStream(ToolUse((WEATHER,), "auto"))
    assert stream.push("Sure") == "Sure"
    assert stream.push(" <tool") == " "  # "<tool" may open a block
    assert stream.push('_call>[{"name": "get_weather", ') == ""
    assert stream.push('"arguments": {"city": "Paris"}}]</tool_call>') == ""
    rest, calls, reason = stream.finish("stop")
    assert (rest, reason) == ("", "tool_calls") and calls[0]["function"]["name"] == "get_weather"
    text = CallStream(ToolUse((WEATHER,), "auto"))
    assert text.push("a <") == "a "
    assert text.push("b> c") == "<b> c"  # not a block after all
    assert text.finish("length") == ("", [], "length")


def test_tools_go_through_a_template_with_a_tools_section_else_the_default_prompt(demo_model: Path) -> None:
    from offload.prompts import Prompts

    prompts = Prompts.load(demo_model)  # its template has no tools section: the default tool prompt
    turns = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = prompts.tokenizer.decode(prompts.encode_chat(turns, tools=[WEATHER]))
    assert "<tools>" in plain and '"get_weather"' in plain and "<tool_call>" in plain
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    later = [*turns, {"role": "assistant", "content": None, "tool_calls": [call]}]
    later.append({"role": "tool", "tool_call_id": "c1", "content": "12 C"})
    text = prompts.tokenizer.decode(prompts.encode_chat(later, tools=[WEATHER]))
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>' in text
    assert "<tool_response>12 C</tool_response>" in text
    prompts.tokenizer.chat_template = (
        "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
        "{% endfor %}{% endif %}\n{% endfor %}assistant:"
    )
    own = prompts.tokenizer.decode(prompts.encode_chat(later, tools=[WEATHER]))
    assert own.startswith("TOOLS get_weather") and "CALL get_weather Oslo" in own  # arguments as an object
    assert "<tools>" not in own and "tool: 12 C" in own


def test_objects_that_list_their_properties_are_closed_to_others() -> None:
    from offload.model.structured import closed

    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}}, "tags": {}},
        "$defs": {"open": {"type": "object", "properties": {"b": {}}, "additionalProperties": True}},
        "anyOf": [{"properties": {"c": {}}}, {"type": "object"}],
        "enum": [{"properties": {}}],
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in out["properties"]  # the name -> schema map itself is not a schema
    assert out["$defs"]["open"]["additionalProperties"] is True  # what a schema states stays
    assert out["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in out["anyOf"][1]
    assert out["enum"] == schema["enum"]  # values, not schemas
