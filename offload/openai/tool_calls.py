"""Tool calls: OpenAI's `tools` and `tool_choice` turned into a prompt, a grammar, and `tool_calls` back.

A reply calls tools by writing a block `<tool_call>...</tool_call>` holding one call `{"name": ..., "arguments":
{...}}` or a JSON list of calls; text before the block is the message's content. (Replies in several blocks, as
some models' own templates write them, are read too.)
The grammar (offload/model/structured.py's llguidance, in its Lark dialect) holds the reply to that shape:
- tool_choice "required": the reply is a call block only, each call naming a tool and its arguments valid against
  the tool's `parameters` schema;
- a named function: one block with one call of that function;
- "auto": free text, until the reply writes `<tool_call>`, from where it must complete valid calls (a lazy
  trigger: the text cannot start a block and leave it malformed); with a `response_format`, the text alternative
  is the reply schema instead.

The tools reach the model through its chat template where the template has a tools section (it mentions `tools`);
otherwise through `tool_prompt`, this engine's stated default, a system message that lists the tools as JSON and
shows the block format. Earlier turns' assistant tool calls and tool results are written the same way.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from offload.model.structured import closed, styled

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # calls one reply may make: a model that keeps adding calls to its list still ends
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request's tools allow: `functions` as OpenAI's function objects, `choice` "auto", "required" or one
    function's name, `parallel` whether a reply may make several calls."""

    functions: tuple[dict, ...]
    choice: str
    parallel: bool = True

    def _call_schema(self, names: list[str]) -> dict:
        options = []
        for f in self.functions:
            if f["name"] in names:
                arguments = f.get("parameters") or {"type": "object", "properties": {}}
                options.append(
                    {
                        "type": "object",
                        "properties": {"name": {"const": f["name"]}, "arguments": arguments},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                )
        return options[0] if len(options) == 1 else {"anyOf": options}

    def grammar(self, reply_schema: str | None = None) -> str:
        """The Lark grammar (llguidance's dialect) of a reply; `reply_schema`: the response_format's JSON schema,
        which a reply that calls no tool follows (auto only)."""
        named = self.choice not in ("auto", "required")
        call = self._call_schema([self.choice] if named else [f["name"] for f in self.functions])
        parallel = self.parallel and not named
        calls = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        body = {"anyOf": [call, calls]} if parallel else call
        lines = ["%llguidance {}", f"body: %json {json.dumps(styled(closed(body)))}"]
        blocks = 'body "</tool_call>"'  # one block: several calls are a list in it
        if self.choice == "auto" and reply_schema is None:  # text, up to a block's opening
            lines += [f"start: TEXT | trigger {blocks}", r"trigger[lazy]: /(.|\n)*<tool_call>/", r"TEXT: /(.|\n)*/"]
        elif self.choice == "auto":  # the reply's JSON, or blocks
            reply = json.dumps(styled(closed(json.loads(reply_schema))))
            lines += [f'start: reply | "<tool_call>" {blocks}', f"reply: %json {reply}"]
        else:
            lines.append(f'start: "<tool_call>" {blocks}')
        return "\n".join(lines) + "\n"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a reply: the text before the first block (None if empty) and each call's name and
        arguments as OpenAI returns them (arguments as JSON text). A reply cut before its blocks closed (a length
        limit) is all content and no calls."""
        start = text.find(CALL_OPEN)
        if start < 0:
            return (text or None), []
        tail = text[start:]
        if _BLOCK.sub("", tail).strip():  # a block left open, or text after the calls
            return text, []
        calls: list = []
        try:
            for block in _BLOCK.findall(tail):
                value = json.loads(block)
                calls.extend(value if isinstance(value, list) else [value])
        except json.JSONDecodeError:
            return text, []
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls):
            return text, []
        return (text[:start].strip() or None), [openai_call(c["name"], c["arguments"]) for c in calls]


def openai_call(name: str, arguments: dict) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def tool_prompt(functions: list[dict]) -> str:
    """The default prompt that lists the tools, for a chat template without a tools section."""
    listed = json.dumps(
        [{k: f[k] for k in ("name", "description", "parameters") if k in f} for f in functions], ensure_ascii=False
    )
    return (
        "You may call functions to answer. The functions you can call, as JSON:\n"
        f"<tools>{listed}</tools>\n"
        "To call functions, reply with nothing but a list of calls between <tool_call> and </tool_call>, each call "
        'a JSON object with the function\'s "name" and its "arguments", for example:\n'
        '<tool_call>[{"name": "function_name", "arguments": {"parameter": "value"}}]</tool_call>\n'
        "If no function fits the request, answer in plain text."
    )


def template_has_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render(messages: list[dict], functions: list[dict] | None, with_template: bool) -> list[dict]:
    """The conversation for a chat template. `with_template`: the template renders tools itself (messages go as
    they are, with arguments as objects, as Hugging Face templates take them); otherwise the tool prompt joins the
    system message, an assistant's calls become its text, and tool results become user turns."""
    if with_template:
        return [_arguments_as_objects(m) for m in messages]
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
                for c in m["tool_calls"]
            ]
            text = (m.get("content") or "") + CALL_OPEN + json.dumps(calls, ensure_ascii=False) + CALL_CLOSE
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>{m.get('content') or ''}</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if functions:
        prompt = tool_prompt(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments_as_objects(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        f = c["function"]
        calls.append({**c, "function": {**f, "arguments": json.loads(f["arguments"] or "{}")}})
    return {**m, "tool_calls": calls}


class CallStream:
    """A streamed reply's text: the content safe to send as it arrives (a tail that may open a call block is held
    back, and everything from a block's opening on), and at the end, the calls."""

    def __init__(self, tools: ToolUse) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of text handed out as content
        self.in_call = False

    def push(self, text: str) -> str:
        """Add a delta's text; the content to send now."""
        self.text += text
        if self.in_call:
            return ""
        at = self.text.find(CALL_OPEN, self.sent)
        if at >= 0:
            self.in_call = True
            end = at
        else:
            held = next((k for k in range(len(CALL_OPEN) - 1, 0, -1) if self.text.endswith(CALL_OPEN[:k])), 0)
            end = len(self.text) - held
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self, reason: str) -> tuple[str, list[dict], str]:
        """(content not sent yet, the calls, the finish_reason) once the reply has ended."""
        _, calls = self.tools.parse(self.text)
        if calls:
            return "", calls, "tool_calls"
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest, [], reason
