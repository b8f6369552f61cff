"""Chat answers as vLLM's server parses them: reasoning split off (``--reasoning-parser``), tools and earlier
calls rendered through the chat template and calls parsed out of the answer (``--tool-call-parser hermes``),
whole and streamed alike (``serve/openai/answer_parsing.py``). No engine: streams are fed scripted updates."""

from __future__ import annotations

import argparse
import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from pat_engine.core.chat import ChatOptions, chat_prompt, render_chat
from pat_engine.core.chat_messages import ChatMessage
from pat_engine.errors import InvalidRequestError, PatEngineError
from pat_engine.outputs import RequestOutput
from pat_engine.serve.async_engine import Update
from pat_engine.serve.cli import _add_answer_parsing_args, _tool_call_parser
from pat_engine.serve.openai.answer_parsing import AnswerParsers, answer_parsers
from pat_engine.serve.openai.protocol import ChatCompletionRequest
from pat_engine.serve.openai.reasoning import REASONING_PARSERS
from pat_engine.serve.openai.streams import chat_stream
from pat_engine.serve.openai.tool_calls import (
    ForcedToolCalls,
    HermesToolParser,
    StreamedToolCalls,
    forced_calls_schema,
    request_tool_parser,
    tool_call_parser,
)
from pat_engine.serve.openai.translate import chat_choice

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": CITY}}
ANSWERS = [
    'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
    '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
    '<tool_call>{"name": "time", "arguments": {}}</tool_call>',
    'two calls, the last cut off <tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}',
    "no call at all, though < and <tool may appear",
    'a broken call <tool_call>{"name": "weather", "arguments": </tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',  # no name: not a call
    "ends on a partial tag <tool_",
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_hermes_calls_are_parsed_and_anything_else_stays_text():
    parser = HermesToolParser()
    first = parser.parse(ANSWERS[0])
    assert first.content == "Let me look.\n" and _calls(first.calls) == [("weather", {"city": "Zürich"})]
    assert "Zürich" in first.calls[0].function.arguments  # kept as written, not \\u-escaped
    assert parser.parse(ANSWERS[1]).content is None
    assert _calls(parser.parse(ANSWERS[1]).calls) == [("weather", {"city": "Oslo"}), ("time", {})]
    assert _calls(parser.parse(ANSWERS[2]).calls) == [("a", {}), ("b", {"x": 1})]
    for text in ANSWERS[3:]:
        assert parser.parse(text).content == text and parser.parse(text).calls == []
    ids = [c.id for c in parser.parse(ANSWERS[1]).calls]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)


LLAMA_ANSWERS = [
    '{"name": "weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
    ' \n{"name": "weather", "parameters": {"city": "Zürich"}}',
    'The answer is {"name": "weather", "parameters": {}}',
    '{"name": "weather", "parameters": ',
    '<|python_tag|>print(1)',
    '{"name": "a", "parameters": {}} and words after it',
    "<|pyt",
]


def test_llama3_json_calls_open_the_answer_or_are_not_calls():
    parser = tool_call_parser("llama3_json")
    assert _calls(parser.parse(LLAMA_ANSWERS[0]).calls) == [("weather", {"city": "Oslo"})]
    assert parser.parse(LLAMA_ANSWERS[0]).content is None
    assert _calls(parser.parse(LLAMA_ANSWERS[1]).calls) == [("a", {}), ("b", {"x": 1})]
    assert _calls(parser.parse(LLAMA_ANSWERS[2]).calls) == [("weather", {"city": "Zürich"})]
    for text in LLAMA_ANSWERS[3:]:
        assert parser.parse(text).content == text and parser.parse(text).calls == []
    assert isinstance(tool_call_parser("llama3"), type(parser)) and isinstance(tool_call_parser("qwen25"),
                                                                                HermesToolParser)
    stream = StreamedToolCalls(parser)  # an answer that does not open with a call streams at once
    assert stream.content(" ") == "" and stream.content("The ans") == " The ans"
    held = StreamedToolCalls(parser)
    assert held.content("<|python") == "" and held.content('_tag|>{"name"') == ""


@pytest.mark.parametrize("name, text", [("hermes", t) for t in ANSWERS] + [("llama3_json", t) for t in LLAMA_ANSWERS])
def test_a_stream_gives_the_content_and_calls_of_the_whole_answer_wherever_it_is_cut(name, text):
    whole = tool_call_parser(name).parse(text)
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1, 7):
            stream = StreamedToolCalls(tool_call_parser(name))
            sent = "".join(stream.content(piece) for piece in (text[:a], text[a:b], text[b:]))
            rest, calls = stream.finish()
            assert sent + rest == (whole.content or "") and _calls(calls) == _calls(whole.calls), (a, b)


class _ScriptedGroup:
    """What chat_stream reads of a RequestGroup: one choice whose engine text grows by the given pieces."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces
        self.handles = [SimpleNamespace(prompt_token_ids=[1, 2], sample_index=0)]
        self.owner = SimpleNamespace(closing=False)

    async def updates(self):
        text, ids = "", []
        for k, piece in enumerate(self.pieces):
            text, ids = text + piece, ids + [k]
            last = k == len(self.pieces) - 1
            yield Update(0, [k], [], list(ids), last, "stop" if last else None, text=text)

    def abort_unfinished(self) -> None:
        pass


def _stream(pieces: list[str], req: ChatCompletionRequest, reasoning: str | None = None) -> list[dict]:
    parsers = answer_parsers(req, "hermes", reasoning)

    async def run():
        return [e async for e in chat_stream(_ScriptedGroup(pieces), req, None, "m", "id", parsers)]
    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_and_whole_chat_answers_agree(parallel):
    text = ANSWERS[1]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
                                parallel_tool_calls=parallel)
    chunks = _stream([text[i:i + 5] for i in range(0, len(text), 5)], req)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed_calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert "".join(d.get("content", "") for d in deltas) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["index"] for c in streamed_calls] == list(range(len(streamed_calls)))

    out = RequestOutput(request_id="r", prompt_token_ids=[1, 2], token_ids=[0], text=text, finish_reason="stop")
    whole = chat_choice(0, out, req, None, answer_parsers(req, "hermes", None))
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    want = [("weather", {"city": "Oslo"}), ("time", {})][:2 if parallel else 1]
    assert _calls(whole.message.tool_calls) == want
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed_calls] == want


def test_a_plain_answer_streams_as_text_and_keeps_its_finish_reason():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    chunks = _stream(["no call ", "<to", "day"], req)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "no call <today"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


def test_which_requests_parse_calls_and_what_is_refused():
    chat = [{"role": "user", "content": "weather?"}]
    assert ChatCompletionRequest(messages=chat, tools=[WEATHER]).parses_tool_calls()  # "auto" by default
    assert not ChatCompletionRequest(messages=chat, tools=[WEATHER], tool_choice="none").parses_tool_calls()
    with pytest.raises(ValidationError, match="needs tools"):
        ChatCompletionRequest(messages=chat, tool_choice="auto")
    assert request_tool_parser(False, None) is None
    assert isinstance(request_tool_parser(True, "hermes"), HermesToolParser)
    with pytest.raises(InvalidRequestError, match='tool_choice "auto" needs a server started with'):
        request_tool_parser(True, None)
    named = {"type": "function", "function": {"name": "weather"}}
    required = ChatCompletionRequest(messages=chat, tools=[WEATHER], tool_choice="required")
    assert (required.forces_tool_calls(), required.named_tool()) == (True, None)
    one = ChatCompletionRequest(messages=chat, tools=[WEATHER], tool_choice=named)
    assert (one.forces_tool_calls(), one.named_tool()) == (True, "weather")
    for choice, match in (("required", "needs tools"), ("sometimes", "tool_choice must be"),
                          ({"type": "function", "function": {"name": "time"}}, "which tools does not offer")):
        with pytest.raises(ValidationError, match=match):
            ChatCompletionRequest(messages=chat, tools=[WEATHER] if match != "needs tools" else None,
                                  tool_choice=choice)
    with pytest.raises(ValidationError, match="tools.0.type"):
        ChatCompletionRequest(messages=chat, tools=[{"type": "retrieval"}])


def test_earlier_calls_and_their_answers_reach_the_template():
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    history = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"})]
    assert history[1].for_template()["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert history[2].for_template()["tool_call_id"] == "c1"
    with pytest.raises(ValidationError, match="not a JSON object"):
        ChatMessage.model_validate({"role": "assistant", "tool_calls": [
            {**call, "function": {"name": "weather", "arguments": "[1]"}}]})
    # a response's message sent back whole, as agent loops do: its extra fields accepted, its thinking rendered
    back = {"role": "assistant", "content": "4", "reasoning": "add", "reasoning_content": "add", "tool_calls": [],
            "refusal": None, "annotations": None, "audio": None, "function_call": None}
    assert ChatMessage.model_validate(back).for_template() == {"role": "assistant", "content": "4",
                                                                "tool_calls": [], "reasoning_content": "add"}
    with pytest.raises(ValidationError, match="two names of one field"):
        ChatMessage.model_validate({**back, "reasoning_content": "other"})
    with pytest.raises(ValidationError, match="function_call"):
        ChatMessage.model_validate({**back, "function_call": {"name": "f", "arguments": "{}"}})
    with pytest.raises(ValidationError, match="only an assistant's message makes tool calls"):
        ChatMessage.model_validate({"role": "user", "content": "x", "tool_calls": [call]})

    class Tokenizer:  # renders what a Qwen-style template reads: the tools, the calls, the answers
        chat_template = "stand-in"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None):
            return json.dumps({"tools": tools, "messages": messages}, sort_keys=True)

    tools = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER]).chat_options().tools
    seen = json.loads(render_chat(Tokenizer(), [m.for_template() for m in history], ChatOptions(tools=tools)))
    assert seen["tools"] == [WEATHER]
    assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


@pytest.mark.parametrize("argv, want", [
    ([], None),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "hermes"),
    (["--enable-auto-tool-choice"], "--tool-call-parser is missing"),
    (["--tool-call-parser", "hermes"], "--enable-auto-tool-choice is missing"),
])
def test_the_tool_call_flags_come_as_vllms_pair(argv, want):
    p = argparse.ArgumentParser()
    _add_answer_parsing_args(p)
    ns = p.parse_args(argv)
    if want is None or want == "hermes":
        assert _tool_call_parser(ns) == want
    else:
        with pytest.raises(PatEngineError, match=want):
            _tool_call_parser(ns)
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "mistral"])
    assert p.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert p.parse_args([]).reasoning_parser is None
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "granite"])


THOUGHTS = [  # (answer, deepseek_r1's (reasoning, content), qwen3's)
    ("<think>\nadd them</think>\n\n4", ("\nadd them", "\n\n4"), ("\nadd them", "\n\n4")),
    ("add them</think>4", ("add them", "4"), ("add them", "4")),  # the template opened the block
    ("<think>cut off while thinking", ("cut off while thinking", None), ("cut off while thinking", None)),
    ("just 4", ("just 4", None), (None, "just 4")),  # qwen3 with thinking off
    ("all thought</think>", ("all thought", None), ("all thought", None)),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("a </thin k", ("a </thin k", None), (None, "a </thin k")),
]


@pytest.mark.parametrize("answer, r1, qwen3", THOUGHTS)
def test_reasoning_is_split_off_whole_and_streamed_alike_wherever_the_answer_is_cut(answer, r1, qwen3):
    for name, want in (("deepseek_r1", r1), ("qwen3", qwen3)):
        parsers = AnswerParsers(REASONING_PARSERS[name])
        parsed = parsers.parse(answer)
        assert (parsed.reasoning, parsed.content) == want, name
        for a in range(len(answer) + 1):
            for b in range(a, len(answer) + 1, 3):
                stream, reasoning, content = parsers.stream(), "", ""
                for piece in (answer[:a], answer[a:b], answer[b:]):
                    more_reasoning, more_content = stream.feed(piece)
                    reasoning, content = reasoning + more_reasoning, content + more_content
                more_reasoning, more_content, calls = stream.finish()
                assert (reasoning + more_reasoning, content + more_content) == (want[0] or "", want[1] or ""), (a, b)


def test_deepseek_reasoning_streams_before_the_answer_ends():
    stream = AnswerParsers(REASONING_PARSERS["deepseek_r1"]).stream()
    assert stream.feed("<think>let me") == ("let me", "")
    assert stream.feed(" see</th") == (" see", "")  # "</th" may be the closing tag: held
    assert stream.feed("ink>it is 4") == ("", "it is 4")
    qwen3 = AnswerParsers(REASONING_PARSERS["qwen3"]).stream()
    assert qwen3.feed("no tag yet") == ("", "")  # thinking or not is undecided until </think> or the end
    assert qwen3.feed("</think>4") == ("no tag yet", "4")


def test_a_thinking_answer_that_calls_a_tool_gives_reasoning_content_and_calls_streamed_and_whole():
    answer = '<think>I need the weather</think>\nchecking <tool_call>{"name": "weather", "arguments": {}}</tool_call>'
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    out = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[0], text=answer, finish_reason="stop")
    whole = chat_choice(0, out, req, None, answer_parsers(req, "hermes", "qwen3")).message
    assert (whole.reasoning, whole.reasoning_content, whole.content) == ("I need the weather",) * 2 + ("\nchecking ",)
    assert _calls(whole.tool_calls) == [("weather", {})]
    chunks = _stream([answer[i:i + 4] for i in range(0, len(answer), 4)], req, "qwen3")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "".join(d.get("reasoning_content", "") for d in deltas)
    assert "".join(d.get("reasoning", "") for d in deltas) == whole.reasoning
    assert "".join(d.get("content", "") for d in deltas) == whole.content
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    plain = chat_choice(0, out, req.model_copy(update={"tools": None}), None, answer_parsers(
        req.model_copy(update={"tools": None}), None, "deepseek_r1")).message
    assert plain.content == answer.split("</think>")[1] and plain.tool_calls == []


def test_the_openai_sdk_reads_the_streamed_and_whole_answers_as_the_same_message():
    """The protocol as the OpenAI SDK reads it: its stream accumulator turns our chunks into the message the
    whole response carries (content, the calls with their arguments, the reasoning vLLM adds)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    answer = '<think>hm</think>ok <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
    state = ChatCompletionStreamState(input_tools=[WEATHER])
    for chunk in _stream([answer[i:i + 3] for i in range(0, len(answer), 3)], req, "qwen3"):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion().choices[0]
    out = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[0], text=answer, finish_reason="stop")
    choice = chat_choice(0, out, req, None, answer_parsers(req, "hermes", "qwen3"))
    whole = ChatCompletion.model_validate({"id": "id", "object": "chat.completion", "created": 0, "model": "m",
                                           "choices": [choice.model_dump()]}).choices[0]
    for got in (streamed, whole):
        assert got.finish_reason == "tool_calls" and got.message.content == "ok "
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == [
            ("weather", {"city": "Oslo"})]
        assert got.message.model_extra["reasoning"] == "hm"


def test_forced_calls_are_read_from_the_json_their_schema_holds_the_answer_to():
    named, required = ForcedToolCalls("weather"), ForcedToolCalls(None)
    assert _calls(named.parse(' {"city": "Oslo"}').calls) == [("weather", {"city": "Oslo"})]
    assert _calls(required.parse('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}]').calls) \
        == [("a", {}), ("b", {"x": 1})]
    for parser, cut in ((named, '{"city": "Os'), (required, '[{"name": "a", "param')):
        assert parser.parse(cut).content == cut and parser.parse(cut).calls == []
        stream = StreamedToolCalls(parser)
        assert stream.content(cut) == ""  # nothing streams as content: the calls come at the end
    tools = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                  tools=[WEATHER, {"type": "function", "function": {"name": "time"}}]).tools
    assert forced_calls_schema(tools, "weather", True) == CITY
    schema = forced_calls_schema(tools, None, False)
    assert schema["maxItems"] == 1 and [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [
        ["weather"], ["time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}


def test_reasoning_can_be_dropped_or_left_unsplit_as_vllm_and_sglang_ask():
    answer = "<think>add</think>4"
    out = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[0], text=answer, finish_reason="stop")
    chat = [{"role": "user", "content": "2+2?"}]
    for fields, want in (({}, ("add", "4")), ({"include_reasoning": False}, (None, "4")),
                         ({"separate_reasoning": False}, (None, answer))):
        req = ChatCompletionRequest(messages=chat, **fields)
        message = chat_choice(0, out, req, None, answer_parsers(req, None, "qwen3")).message
        assert (message.reasoning, message.content) == want, fields
        streamed = _stream([answer[:3], answer[3:9], answer[9:]], req, "qwen3")
        deltas = [c["choices"][0]["delta"] for c in streamed]
        assert "".join(d.get("reasoning", "") for d in deltas) == (want[0] or "")
        assert "".join(d.get("content", "") for d in deltas) == want[1]


def test_the_thinking_sent_back_counts_toward_the_chat_s_character_limit():
    long = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "4", "reasoning": "y" * 400}]
    with pytest.raises(InvalidRequestError, match="messages hold 402 characters, more than the 320"):
        chat_prompt(None, long, ChatOptions(), max_model_len=10)  # refused before any tokenizer is needed
