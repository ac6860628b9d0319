"""Structured outputs on the endpoint and in batch jobs, through the openai client, on the real model: response_format
(json_schema, json_object), tools with tool_choice required, named and auto, streaming, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from serving import BOUND, start_server

from offload.cli import main

ENGINE = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "8"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {
            "type": "array",
            "items": {"type": "string", "enum": ["en", "fr", "ja"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "pets": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "enum": ["cat", "dog"]},
                    "weight_kg": {"type": "number", "minimum": 0, "maximum": 90},
                },
                "required": ["kind", "weight_kg"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
        "nickname": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "languages", "pets"],
    "additionalProperties": False,
}
SUMMARY = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 40}, "positive": {"type": "boolean"}},
    "required": ["topic", "positive"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def client(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    served = start_server(smollm2_gguf, log, "--served-model-name", "smollm2", *ENGINE)
    try:
        yield openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=BOUND)
    finally:
        served.stop()


def ask(client: openai.OpenAI, messages: list[dict], **fields):
    return client.chat.completions.create(model="smollm2", messages=messages, **({"max_tokens": 200} | fields)).choices


@pytest.mark.slow
def test_json_schema_replies_parse_and_validate(client: openai.OpenAI) -> None:
    for k, name in enumerate(("Alice", "Bob", "Chen", "Dana")):
        sampling = {"temperature": 0} if k % 2 == 0 else {"temperature": 0.8, "seed": k}
        messages = [{"role": "user", "content": f"Describe {name}, who has pets, as JSON."}]
        (choice,) = ask(client, messages, response_format=schema_format("person", PERSON), **sampling)
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.slow
def test_json_object_and_the_completions_endpoint(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": 'Reply with a JSON object whose keys are "city" and "country", for Rome.'}]
    (choice,) = ask(client, messages, response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(choice.message.content), dict)
    completion = client.completions.create(
        model="smollm2",
        prompt="A review of a film, as JSON:",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": schema_format("summary", SUMMARY)},
    ).choices[0]
    assert completion.finish_reason == "stop"
    jsonschema.validate(json.loads(completion.text), SUMMARY)


@pytest.mark.slow
def test_a_forced_tool_call_comes_back_as_tool_calls(client: openai.OpenAI) -> None:
    (choice,) = ask(client, ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", temperature=0)
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = {"type": "function", "function": {"name": "get_time"}}
    (choice,) = ask(client, ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=named, temperature=0.7, seed=3)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and "city" in json.loads(call.function.arguments)


@pytest.mark.slow
def test_auto_replies_are_text_or_valid_calls_and_a_conversation_continues(client: openai.OpenAI) -> None:
    """With tool_choice auto the model chooses; this 135M model answers the weather question in text (it was not
    trained to call tools), and whatever it chooses comes back well formed: text without a call block, or calls."""
    (choice,) = ask(client, ASK_WEATHER, tools=[WEATHER], temperature=0)
    message = choice.message
    if message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    else:
        assert "<tool_call>" not in message.content
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "clear"}'},
    ]
    (choice,) = ask(client, turns, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=30)
    assert choice.message.content and choice.message.tool_calls is None


@pytest.mark.slow
def test_streamed_content_and_streamed_tool_calls(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe Emil as JSON."}]
    chunks = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=200,
        temperature=0,
        response_format=schema_format("person", PERSON),
        stream=True,
    )
    content, reasons = "", []
    for chunk in chunks:
        content += chunk.choices[0].delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(content), PERSON)

    chunks = client.chat.completions.create(
        model="smollm2",
        messages=ASK_WEATHER,
        max_tokens=100,
        temperature=0,
        tools=[WEATHER],
        tool_choice="required",
        stream=True,
    )
    calls: dict[int, dict] = {}
    reasons, text = [], ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
    assert reasons[-1] == "tool_calls" and "<tool_call>" not in text
    assert calls and all(c["id"] and c["name"] == "get_weather" for c in calls.values())
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.slow
def test_bad_schemas_and_tool_choices_are_400_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        ({"response_format": schema_format("x", {"type": "objectx"})}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            ask(client, ASK_WEATHER, **fields)
        assert refused.value.body["param"] == param, refused.value.body


@pytest.mark.slow
def test_a_batch_job_of_mixed_schemas_and_tools(smollm2_gguf: Path, tmp_path: Path) -> None:
    from offload.gguf.resolve import resolve_model

    model = resolve_model(smollm2_gguf).name  # what an OpenAI line names: the served folder's name
    bodies = [
        {
            "messages": [{"role": "user", "content": "Describe Gus as JSON."}],
            "response_format": schema_format("p", PERSON),
        },
        {
            "messages": [{"role": "user", "content": "Summarize: a great day at the beach."}],
            "response_format": schema_format("s", SUMMARY),
        },
        {"messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required"},
        {
            "messages": [{"role": "user", "content": "Describe Hana as JSON."}],
            "response_format": schema_format("p", PERSON),
            "n": 2,
            "temperature": 0.8,
            "seed": 1,
        },
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"custom_id": f"r{i}", "url": "/v1/chat/completions", "body": {"model": model, "max_tokens": 200, **b}}
        for i, b in enumerate(bodies)
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["batch", "--model", str(smollm2_gguf), "--input", str(src), "--output", str(out), *ENGINE]) == 0
    results = {r["custom_id"]: r["response"]["body"]["choices"] for r in map(json.loads, out.read_text().splitlines())}
    for i, body in enumerate(bodies):
        for choice in results[f"r{i}"]:
            if "tools" in body:
                assert choice["finish_reason"] == "tool_calls"
                args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
                jsonschema.validate(args, WEATHER["function"]["parameters"])
            else:
                jsonschema.validate(
                    json.loads(choice["message"]["content"]), body["response_format"]["json_schema"]["schema"]
                )
    assert len(results["r3"]) == 2
