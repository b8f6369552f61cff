"""Chat templates as vLLM's server takes them (``core/chat.py``): ``--chat-template`` (a template or a file)
in place of the tokenizer's, and a request's ``chat_template_kwargs`` and ``continue_final_message``, over
HTTP and in batch lines; each misuse refused by name before anything is queued."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pat_engine import Engine, InvalidRequestError, SamplingParams
from pat_engine.core.chat import (
    ChatOptions,
    apply_chat_template,
    install_chat_template,
    render_chat,
    resolve_chat_template,
)
from pat_engine.core.inputs import load_tokenizer
from pat_engine.serve.batch.lines import LineError, SamplingDefaults, parse_line
from pat_engine.serve.launcher import BackgroundServer
from pat_engine.serve.server import ServerConfig, build_app

# Qwen3's switch, in the tiny tokenizer's words: the template reads a variable only a request can set
THINKING = ("{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
            "the end{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "the water is good"}]
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_a_named_template_is_its_text_or_a_file_and_its_syntax_is_checked(tmp_path):
    assert resolve_chat_template(THINKING) == THINKING
    path = tmp_path / "chat.jinja"
    path.write_text(THINKING)
    assert resolve_chat_template(str(path)) == THINKING
    with pytest.raises(InvalidRequestError, match="'missing.jinja': no such file, and no Jinja markup"):
        resolve_chat_template("missing.jinja")
    with pytest.raises(InvalidRequestError, match="TemplateSyntaxError"):
        resolve_chat_template("{% for m in messages %}{{ m }}")  # the loop never ends


def test_the_deployments_template_replaces_the_tokenizers(model_dir, tmp_path):
    own = load_tokenizer(model_dir("llama"))
    named = load_tokenizer(model_dir("llama"))
    install_chat_template(named, THINKING, "tiny")
    assert own.chat_template != THINKING and named.chat_template == THINKING
    # the variable reaches the template: absent, the template's default; set, what the request asked
    plain = render_chat(named, CHAT)
    assert plain == render_chat(own, CHAT) == "<|user|>the water is good\n<|assistant|>"
    off = render_chat(named, CHAT, ChatOptions(template_kwargs={"enable_thinking": False}))
    assert off == plain + "the end"
    assert render_chat(named, CHAT, ChatOptions(template_kwargs={"enable_thinking": True})) == plain
    with pytest.raises(InvalidRequestError, match="needs a tokenizer, and 'bare' has none"):
        install_chat_template(None, THINKING, "bare")


def test_continue_final_message_leaves_the_last_message_open(model_dir):
    tokenizer = load_tokenizer(model_dir("llama"))
    chat = CHAT + [{"role": "assistant", "content": "it is"}]
    closed = render_chat(tokenizer, chat, ChatOptions(add_generation_prompt=False))
    assert closed == "<|user|>the water is good\n<|assistant|>it is\n"
    assert render_chat(tokenizer, chat, ChatOptions(False, continue_final_message=True)) == closed[:-1]


@pytest.mark.parametrize("options, match", [
    (dict(continue_final_message=True), "continue_final_message and add_generation_prompt cannot both be true"),
    (dict(template_kwargs={"tokenize": True}), "may not set 'tokenize'"),
    (dict(template_kwargs={"messages": [], "chat_template": "x"}), "may not set 'chat_template', 'messages'"),
])
def test_options_that_would_change_how_the_chat_is_rendered_are_refused(options, match):
    with pytest.raises(InvalidRequestError, match=match):
        ChatOptions(**options)


def test_batch_lines_take_the_chat_fields_with_messages_only(model_dir):
    tokenizer = load_tokenizer(model_dir("llama"))
    install_chat_template(tokenizer, THINKING, "tiny")
    line = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 4}
    item = parse_line(1, line, tokenizer, 512, SamplingDefaults())
    assert item.input.prompt == apply_chat_template(tokenizer, CHAT, ChatOptions(template_kwargs={
        "enable_thinking": False}))
    openai = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": line}
    item_plain = parse_line(2, openai, tokenizer, 512, SamplingDefaults())
    assert item_plain.input.prompt == item.input.prompt
    with pytest.raises(LineError, match="chat_template_kwargs: only with messages"):
        parse_line(3, {"prompt": "hi", "chat_template_kwargs": {}}, tokenizer, 512, SamplingDefaults())
    with pytest.raises(LineError, match="may not set 'tokenize'"):
        parse_line(4, {**line, "chat_template_kwargs": {"tokenize": True}}, tokenizer, 512, SamplingDefaults())
    # an OpenAI chat line offering tools: its calls parsed out by the job's parser, refused without one
    tools = {**openai, "body": {**line, "tools": [TOOL]}}
    with pytest.raises(LineError, match='tool_choice "auto" needs a server started with'):
        parse_line(5, tools, tokenizer, 512, SamplingDefaults())
    item = parse_line(6, tools, tokenizer, 512, SamplingDefaults(), tool_call_parser="hermes")
    as_text = parse_line(7, {**tools, "body": {**line, "tools": [TOOL], "tool_choice": "none"}}, tokenizer, 512,
                         SamplingDefaults())
    assert item.parsers is not None and as_text.parsers is None
    assert item.input.prompt == as_text.input.prompt and len(as_text.input.prompt) > len(item_plain.input.prompt)


def test_a_template_the_engine_cannot_read_fails_before_any_worker_starts(model_dir):
    with pytest.raises(InvalidRequestError, match="'chat.jinja': no such file"):
        Engine(model_dir("llama"), chat_template="chat.jinja")


def test_an_engine_started_with_a_template_serves_chats_through_it(model_dir, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(THINKING)
    with Engine(model_dir("llama"), tp=1, dp=1, dtype="float32", max_model_len=256,
                chat_template=str(path)) as engine, \
            BackgroundServer(build_app(engine, ServerConfig("tiny", tool_call_parser="hermes",
                                                               reasoning_parser="qwen3"))) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        def chat(**fields) -> httpx.Response:
            return client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "temperature": 0,
                                                             **fields})

        for kwargs in (None, {"enable_thinking": False}):
            r = chat(chat_template_kwargs=kwargs)
            assert r.status_code == 200, r.text
            want = apply_chat_template(engine.tokenizer, CHAT, ChatOptions(template_kwargs=kwargs or {}))
            assert r.json()["usage"]["prompt_tokens"] == len(want)
            assert r.json()["choices"][0]["message"]["content"] == engine.generate(
                [want], SamplingParams(max_new_tokens=3), use_tqdm=False)[0].text
        assert len(apply_chat_template(engine.tokenizer, CHAT, ChatOptions(template_kwargs={
            "enable_thinking": False}))) > len(apply_chat_template(engine.tokenizer, CHAT))

        r = chat(messages=CHAT + [{"role": "assistant", "content": "it is"}], add_generation_prompt=False,
                 continue_final_message=True)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenizer(
            "<|user|>the water is good\n<|assistant|>it is", add_special_tokens=False)["input_ids"])
        for fields, match in ((dict(continue_final_message=True), "cannot both be true"),
                              (dict(chat_template_kwargs={"add_generation_prompt": False}),
                               "may not set 'add_generation_prompt'"),
                              (dict(chat_template_kwargs={"enable_thinking": "x" * 9000}),
                               "messages, tools and chat_template_kwargs hold 90")):
            r = chat(**fields)
            assert r.status_code == 400 and match in r.text, r.text
        assert chat().status_code == 200  # the engine is still up

        # tools go through the template; the answer (the tiny model's words: no call) comes back as text
        r = chat(tools=[TOOL])
        assert r.status_code == 200, r.text
        want = apply_chat_template(engine.tokenizer, CHAT, ChatOptions(tools=[TOOL]))
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["prompt_tokens"] == len(want) > len(apply_chat_template(engine.tokenizer, CHAT))
        assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "length"
        assert choice["message"]["reasoning"] is None  # qwen3's parser: no tags, thinking was off
        assert choice["message"]["content"] == engine.generate([want], SamplingParams(max_new_tokens=3),
                                                               use_tqdm=False)[0].text

        # the routes render and tokenize chats (and decode) off the event loop that serves every stream
        seen = []

        class Watched:
            def __init__(self, inner):
                self._inner = inner

            def __getattr__(self, name):
                return getattr(self._inner, name)

            def __call__(self, *args, **kwargs):
                seen.append(_loop_running())
                return self._inner(*args, **kwargs)

            def decode(self, *args, **kwargs):
                seen.append(_loop_running())
                return self._inner.decode(*args, **kwargs)

        own, engine.tokenizer = engine.tokenizer, Watched(engine.tokenizer)
        try:
            assert chat().status_code == 200
            assert client.post("/tokenize", json={"messages": CHAT}).status_code == 200
            assert client.post("/detokenize", json={"tokens": [5, 6]}).status_code == 200
        finally:
            engine.tokenizer = own
        assert seen and not any(seen)

        # offline, as vLLM's LLM.chat: one conversation or several, the same options, the same tokens
        greedy = SamplingParams(max_new_tokens=3)
        ids = apply_chat_template(engine.tokenizer, CHAT, ChatOptions(template_kwargs={"enable_thinking": False}))
        want = engine.generate([ids], greedy, use_tqdm=False)[0]
        one = engine.chat(CHAT, greedy, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
        assert one[0].prompt_token_ids == ids and one[0].token_ids == want.token_ids
        two = engine.chat([CHAT, CHAT], greedy, use_tqdm=False)
        assert [o.prompt_token_ids for o in two] == [apply_chat_template(engine.tokenizer, CHAT)] * 2
        with pytest.raises(InvalidRequestError, match="conversation 1: message 0: role: Input should be"):
            engine.chat([CHAT, [{"role": "robot", "content": "hi"}]], greedy)
        with pytest.raises(InvalidRequestError, match="a chat is a list of messages, got str"):
            engine.chat(["hi"], greedy)
        assert engine.chat(CHAT, greedy, use_tqdm=False)[0].token_ids == two[0].token_ids
        with_tools = engine.chat(CHAT, greedy, tools=[TOOL], use_tqdm=False)[0]
        assert with_tools.prompt_token_ids == apply_chat_template(engine.tokenizer, CHAT, ChatOptions(tools=[TOOL]))
        with pytest.raises(InvalidRequestError, match="tools.0.type"):
            engine.chat(CHAT, greedy, tools=[{"type": "retrieval"}])
        with pytest.raises(InvalidRequestError, match="cannot both be true"):
            engine.chat(CHAT, greedy, continue_final_message=True)
