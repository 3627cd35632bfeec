#!/usr/bin/env python3
"""A tool-using conversation with pdserve through the official `openai` client alone.

The model is offered one function, `get_weather(city)`; the script runs whatever call it
makes (a stand-in that makes up the weather), sends the result back as a `tool` message,
and prints the model's final answer. On `make up`'s default model:

    python examples/tool_call.py --base-url http://localhost:8000/v1 --tool-choice required

A 135M model rarely calls by itself, so `--tool-choice required` (or `get_weather`, to
name the function) has the output constrained to a valid call; models trained for tool use
(Qwen2.5-Instruct and up) call with the default `auto`. Prints each step to stderr and, at
the end, one JSON line on stdout: {"calls": [...], "answer": "..."}.
"""

from __future__ import annotations

import argparse
import json
import sys

from openai import OpenAI

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def get_weather(city: str) -> dict[str, object]:
    """The stand-in for a real weather service."""
    return {"city": city, "temperature_c": 21, "sky": "clear"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://localhost:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--question", default="What is the weather like in Paris today?")
    parser.add_argument(
        "--tool-choice", default="auto", help="auto, required, none, or a function's name to force that one"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    choice = args.tool_choice
    if choice not in ("auto", "required", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    messages: list[dict[str, object]] = [{"role": "user", "content": args.question}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=args.max_tokens, temperature=0
    ).choices[0]
    calls = first.message.tool_calls or []
    print(f"model: {first.message.content or ''} ({len(calls)} call(s), {first.finish_reason})", file=sys.stderr)
    if not calls:
        print(json.dumps({"calls": [], "answer": first.message.content}))
        return 0
    messages.append(
        {
            "role": "assistant",
            "content": first.message.content,
            "tool_calls": [c.model_dump(include={"id", "type", "function"}) for c in calls],
        }
    )
    done = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        known = call.function.name == "get_weather"
        result = get_weather(str(arguments.get("city", ""))) if known else {"error": "no such function"}
        print(f"call: {call.function.name}({arguments}) -> {result}", file=sys.stderr)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
        done.append({"name": call.function.name, "arguments": arguments, "result": result})
    final = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=args.max_tokens, temperature=0
    ).choices[0]
    print(f"answer: {final.message.content}", file=sys.stderr)
    print(json.dumps({"calls": done, "answer": final.message.content}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
