"""An agent's rollout through the OpenAI SDK: pat-serve as the model server, tool calls in a loop.

Each episode is the loop agent frameworks run against vLLM or SGLang: the chat goes to
``/v1/chat/completions`` with the tools; the model's calls come back as ``tool_calls`` (held to the tools'
schemas by ``tool_choice="required"``, so even the tiny random model here calls them correctly), the
script runs each call and appends its result as a ``tool`` message, and a last turn asks for the answer as
JSON (``response_format`` with a schema). The assistant's messages go back into the chat as the SDK gives
them. Midway the engine switches layout live (TP1xDP2 -> TP2xDP1), and every turn still answers.

    python examples/agent_tools.py                   # the built-in tiny model, CPU, about 10 s
    python examples/agent_tools.py --episodes 4

The tiny model's words mean nothing; what the script shows is the protocol: calls that parse and name an
offered tool with valid arguments, tool results rendered back through the chat template, and a final JSON
answer that matches its schema.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from openai import OpenAI  # noqa: E402

from pat_engine import Engine  # noqa: E402
from pat_engine.serve.launcher import BackgroundServer  # noqa: E402
from pat_engine.serve.server import ServerConfig, build_app  # noqa: E402
from pat_engine.tiny_model import write_tiny_model  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen", "Tromso"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "distance", "description": "km between two cities",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "string", "enum": ["Oslo", "Bergen", "Tromso"]},
                                               "b": {"type": "string", "enum": ["Oslo", "Bergen", "Tromso"]}},
                                               "required": ["a", "b"], "additionalProperties": False}}}]
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen", "Tromso"]},
                                           "go": {"type": "boolean"}},
          "required": ["city", "go"], "additionalProperties": False}
WEATHER = {"Oslo": "rain", "Bergen": "rain", "Tromso": "snow"}
KM = {frozenset(("Oslo", "Bergen")): 463, frozenset(("Oslo", "Tromso")): 1145, frozenset(("Bergen", "Tromso")): 1430}


def run_tool(name: str, arguments: dict) -> str:
    if name == "weather":
        return WEATHER[arguments["city"]]
    a, b = arguments["a"], arguments["b"]
    return "0" if a == b else str(KM[frozenset((a, b))])


def no_blank_tokens(tokenizer, vocab: int) -> dict[str, float]:
    """A logit bias against tokens that are only white space: a random model would fill JSON's optional
    white space up to the token limit (a trained one does not need this)."""
    return {str(t): -100 for t in range(vocab) if tokenizer.decode([t]) and not tokenizer.decode([t]).strip()}


def episode(client: OpenAI, model: str, seed: int, bias: dict[str, float], turns: int = 2) -> dict:
    """One agent episode: ``turns`` rounds of tool calls, then a JSON answer; returns what happened."""
    messages: list = [{"role": "system", "content": "plan a trip"},
                      {"role": "user", "content": "where should I go this weekend"}]
    calls = []
    for turn in range(turns):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=96, seed=seed + turn, temperature=1.0, logit_bias=bias)
        message = reply.choices[0].message
        messages.append(message)  # the assistant's turn goes back as the SDK gives it
        for call in message.tool_calls or []:
            arguments = json.loads(call.function.arguments)
            result = run_tool(call.function.name, arguments)
            calls.append((call.function.name, arguments, result))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(
        model=model, messages=messages, max_tokens=96, seed=seed, temperature=1.0, logit_bias=bias,
        response_format={"type": "json_schema", "json_schema": {"name": "plan", "schema": ANSWER}})
    text = final.choices[0].message.content
    answer = json.loads(text, strict=False) if final.choices[0].finish_reason == "stop" else None
    return {"calls": calls, "answer": answer, "raw": text}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=3)
    p.add_argument("--model-dir", type=Path, default=None, help="a checkpoint (default: the tiny model, written)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(args.model_dir or write_tiny_model(Path(tmp) / "tiny"))
        with Engine(model, tp=1, dp=2, dtype="float32", max_model_len=512) as engine, \
                BackgroundServer(build_app(engine, ServerConfig("tiny"))) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused")
            bias = no_blank_tokens(engine.tokenizer, min(engine.arch.vocab_size, len(engine.tokenizer)))
            results = []
            for i in range(args.episodes):
                if i == args.episodes // 2:
                    engine.reconfigure(tp=2)  # live, between turns: the next episodes run at TP2xDP1
                results.append(episode(client, "tiny", seed=100 * i, bias=bias))
                print(f"episode {i} ({engine.layout}): calls {results[-1]['calls']}; answer {results[-1]['answer']}")
    ok = all(len(r["calls"]) == 2 and r["answer"] is not None for r in results)
    print("every turn called an offered tool and every episode answered in its schema" if ok
          else "a turn made no call, or an answer was cut off")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
