"""Tool calling in the server: the tool-call formats parsed whole and streamed (nothing of a call
is sent as content, nothing of the answer is lost), the request's tools and tool messages checked,
and a real HTTP server (uvicorn on 127.0.0.1) talked to by the `openai` client, its engine replaced
by one that answers a scripted text: tool_calls come back parsed, streamed or not, and the tools
and the tool results reach the prompt through the chat template."""
import json
import threading
import time

import httpx
import pytest

from medusa_jax.chat import check_messages, render_chat
from medusa_jax.serve.protocol import RequestError, check_request
from medusa_jax.serve.tools import TOOL_PARSERS, ToolError, check_tools

MODEL = "scripted"

#: A Hermes-style chat template (the shape of Qwen2.5's): the tools in the system turn, calls as
#: <tool_call> blocks, a tool's result as a <tool_response> in a user turn.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions:<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer a call as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

HERMES_ANSWER = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


# ---- the formats ----------------------------------------------------------------------------------

def _fn(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_hermes_calls_are_parsed_with_the_text_before_them_as_content():
    parse = TOOL_PARSERS["hermes"].parse
    content, calls = parse(HERMES_ANSWER)
    assert content == "Let me look that up.\n"
    assert [_fn(c) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    # a call alone: no content; a last block cut before its end tag (EOS right after the JSON)
    content, calls = parse('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}')
    assert content is None and [_fn(c) for c in calls] == [("get_time", {"tz": "UTC"})]
    # not a call: the answer whole, as content
    for text in ("No tools needed: it is sunny.", "<tool_call>{not json}</tool_call>", "x <tool_call>[1, 2]",
                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        assert parse(text) == (text, []), text


def test_llama3_json_calls_are_the_whole_answer_or_none():
    parse = TOOL_PARSERS["llama3_json"].parse
    content, calls = parse(' {"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and [_fn(c) for c in calls] == [("get_weather", {"city": "Oslo"})]
    content, calls = parse('{"name": "get_time", "arguments": {}}; {"name": "get_weather", "parameters": {"city": '
                           '"Rome"}}\n')
    assert [_fn(c) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    for text in ("The weather is fine.", '{"name": "f", "parameters": {}} and some words', '{"city": "Oslo"}',
                 '{"name": "f", "parameters": {', ""):
        assert parse(text) == (text, []), text


def test_pythonic_calls_are_a_list_of_calls_with_literal_arguments():
    parse = TOOL_PARSERS["pythonic"].parse
    content, calls = parse(' [get_weather(city="Paris", days=3), get_time()]\n')
    assert content is None and [_fn(c) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                            ("get_time", {})]
    _, calls = parse('[f(x=-1.5, y=[1, (2, "b")], z={"k": None, "t": True})]')
    assert [_fn(c) for c in calls] == [("f", {"x": -1.5, "y": [1, [2, "b"]], "z": {"k": None, "t": True}})]
    # not a call list (positional arguments, attributes, code, non-JSON values, **kwargs): content, whole
    for text in ("The weather is fine.", "[1, 2, 3]", "[]", "[f(1)]", "[a.b(x=1)]", "[f(x=g())]", "[f(x=1e999)]",
                 "[f(x={1, 2})]", "[f(**k)]", "[f(x=1)] and more", "[f(x=1)", "[f(x=__import__('os'))]"):
        assert parse(text) == (text, []), text


def test_mistral_calls_follow_their_marker_with_ids_mistral_takes_back():
    parse = TOOL_PARSERS["mistral"].parse
    content, calls = parse('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                           '{"name": "get_time", "arguments": {}}]')
    assert content == "Sure." and [_fn(c) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls) and calls[0]["id"] != calls[1]["id"]
    # newer tokenizers: name[ARGS]{...} per call
    content, calls = parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}')
    assert content is None and [_fn(c) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    # a marker inside a string argument is the argument's text, in either form
    content, calls = parse('[TOOL_CALLS]note[ARGS]{"text": "a [TOOL_CALLS] b [ARGS] c"} [TOOL_CALLS] f[ARGS] {}')
    assert [_fn(c) for c in calls] == [("note", {"text": "a [TOOL_CALLS] b [ARGS] c"}), ("f", {})]
    content, calls = parse('[TOOL_CALLS][{"name": "note", "arguments": {"text": "x[ARGS]y"}}]')
    assert [_fn(c) for c in calls] == [("note", {"text": "x[ARGS]y"})]
    for text in ("No call.", "[TOOL_CALLS] not json", '[TOOL_CALLS][{"arguments": {}}]', "[TOOL_CALLS]f[ARGS][1]",
                 '[TOOL_CALLS]bad name[ARGS]{}', '[{"name": "f", "arguments": {}}]', '[TOOL_CALLS]f[ARGS]{} g',
                 '[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]', '[TOOL_CALLS]f[ARGS]{"a": 1'):
        assert parse(text) == (text, []), text


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": "\\udc00"}}'),
    ("pythonic", '[f(x="\\ud800")]'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": "\\ud800"}}]'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "\\udfff"}')])
def test_a_call_that_cannot_be_sent_as_utf8_is_content(fmt, text):
    """A JSON escape of a lone surrogate (or an empty name) makes a call the response could not carry
    (UTF-8 has no surrogates: the server answered 500): the answer is content, whole."""
    assert TOOL_PARSERS[fmt].parse(text) == (text, [])
    text.encode("utf-8")  # the content itself is ASCII, as the model wrote it


def test_the_cli_offers_every_parser():
    from medusa_jax.cli.serve import TOOL_PARSER_NAMES

    assert set(TOOL_PARSER_NAMES) == set(TOOL_PARSERS)


@pytest.mark.parametrize("fmt,answers", [
    ("hermes", [HERMES_ANSWER, "A plain answer with < and <tool but no call.", "<tool_call>{broken",
                "Text then <tool_cal"]),
    ("llama3_json", ['  {"name": "get_time", "parameters": {}}', "  Plain text.", "{ not json"]),
    ("pythonic", [' [get_time(), get_weather(city="Rome")]', "Plain [text].", "[f(x=1) broken"]),
    ("mistral", ['Sure.[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "Plain [TOOL text", "a [TOOL_CALLS] b"])])
def test_streaming_releases_only_content_and_loses_nothing(fmt, answers):
    """Character by character, what `releasable` lets out never shrinks, is never part of a call,
    and with the rest that parsing gives at the end makes the whole content."""
    parser = TOOL_PARSERS[fmt]
    for answer in answers:
        sent = 0
        for n in range(len(answer) + 1):
            r = parser.releasable(answer[:n])
            assert sent <= max(r, sent) <= n
            sent = max(r, sent)
        content, calls = parser.parse(answer)
        assert (content or "").startswith(answer[:sent]), (answer, sent)
        if not calls:
            assert content == answer


def test_tools_and_tool_choice_are_checked_as_openai_checks_them():
    assert check_tools(None, None) == (None, "none")
    assert check_tools([WEATHER], None) == ([WEATHER], "auto")
    assert check_tools([WEATHER], "none") == ([WEATHER], "none")
    assert check_tools([], "none") == (None, "none")
    bad = [("nope", None, "tools: expected a list"),
           ([{"type": "retrieval"}], None, r"tools\[0\].type"),
           ([{"type": "function", "function": {"name": "a b"}}], None, r"tools\[0\].function.name"),
           ([WEATHER, WEATHER], None, r"tools\[1\].function.name: the function 'get_weather' is given twice"),
           ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "parameters"),
           ([WEATHER], "required", "tool_choice: 'required' is not supported"),
           ([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, "a named function"),
           ([WEATHER], "sometimes", "tool_choice: expected 'none' or 'auto'"),
           (None, "auto", "tool_choice: 'auto' needs tools")]
    for tools, choice, message in bad:
        with pytest.raises(ToolError, match=message):
            check_tools(tools, choice)
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "required"}
    with pytest.raises(RequestError) as e:
        check_request(body, [MODEL], 64, True)
    assert e.value.param == "tool_choice" and e.value.code == "unsupported_parameter"
    with pytest.raises(RequestError, match="tools is not supported"):  # not a completions field
        check_request({"prompt": "x", "tools": [WEATHER]}, [MODEL], 64, False)


def test_tool_messages_are_checked_and_their_arguments_decoded_for_the_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    out = check_messages([{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}])
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert out[2] == {"role": "tool", "content": "18 C, clear", "tool_call_id": "call_1"}
    bad = [({"role": "tool", "content": "x"}, r"messages\[0\].tool_call_id"),
           ({"role": "assistant", "tool_calls": {"id": "x"}}, r"messages\[0\].tool_calls: expected a list"),
           ({"role": "assistant", "tool_calls": [dict(call, function={"name": "f", "arguments": "{x"})]},
            r"messages\[0\].tool_calls\[0\].function.arguments: not valid JSON"),
           ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, r"function.name")]
    for message, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            check_messages([message])


# ---- a real server, a scripted engine --------------------------------------------------------------

class _ScriptedEngine:
    """An engine that answers every request with the token ids of `answer` (a few per step, from its
    own thread) and keeps each request's prompt ids."""
    max_len, max_batch, queued, live, waiting, stats, eos = 2048, 4, 0, 0, 0, {}, (0,)

    class cfg:
        vocab_size = 49152

    def __init__(self, tokenizer):
        self.tokenizer, self.answer, self.prompts, self.scored = tokenizer, "", [], 0

    def prompt_logprobs(self, prompt, top=0, stop=None, keep=False):
        from medusa_jax.decoding.requests import TokenLogprob

        self.scored += 1
        return [None] + [TokenLogprob(t, -1.0, ((t, -1.0),) * top) for t in prompt[1:]]

    def submit(self, request, on_event=None):
        from medusa_jax.decoding.requests import Finished, RequestHandle

        handle = RequestHandle(request, on_event)
        self.prompts.append(list(request.prompt))
        ids = self.tokenizer.encode(self.answer, add_special_tokens=False)

        def run():
            for k in range(0, len(ids), 3):
                handle._emit("tokens", ids[k:k + 3])
            handle._emit("done", Finished("eos", tokens=ids, steps=(len(ids) + 2) // 3,
                                          prompt_tokens=len(request.prompt)))
        threading.Thread(target=run, daemon=True).start()
        return handle

    def cancel_all(self):
        pass

    def start(self):
        pass

    def stop(self, cancel=True, timeout=None):
        pass


@pytest.fixture(scope="module")
def tool_server(smollm2_path):
    import uvicorn

    from medusa_jax.convert.load import load_tokenizer
    from medusa_jax.serve.app import create_app
    from tests.test_serve import free_port

    tokenizer = load_tokenizer(smollm2_path)
    tokenizer.chat_template = HERMES_TEMPLATE
    engine = _ScriptedEngine(tokenizer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, tokenizer, MODEL, tool_call_parser="hermes"),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(10)


@pytest.mark.slow
def test_tool_calls_come_back_parsed_streamed_or_not(tool_server):
    import openai

    url, engine = tool_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    engine.answer = HERMES_ANSWER
    messages = [{"role": "user", "content": "What's the weather and the time in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up.\n"
    got = [(c.function.name, json.loads(c.function.arguments), c.type) for c in choice.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}, "function"), ("get_time", {}, "function")]
    # the tools reached the model through the template
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "<tools>" in prompt and '"get_weather"' in prompt and '"The weather in a city now"' in prompt

    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        assert "<tool" not in content  # a call's text is never streamed as content
        for c in delta.tool_calls or ():
            calls[c.index] = (c.function.name, json.loads(c.function.arguments), c.id)
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Let me look that up.\n" and reasons[-1] == "tool_calls"
    assert [calls[k][:2] for k in sorted(calls)] == [(n, a) for n, a, _ in got]
    assert all(calls[k][2].startswith("call_") for k in calls)

    # parallel_tool_calls false: the answer's first call only, streamed or not (OpenAI: at most one)
    one = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                         parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"] and one.finish_reason == "tool_calls"
    streamed = [c for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                                              stream=True, parallel_tool_calls=False)
                for c in chunk.choices[0].delta.tool_calls or ()]
    assert [c.function.name for c in streamed] == ["get_weather"]

    # the second turn: the call and its result rendered into the prompt
    call = choice.message.tool_calls[0]
    engine.answer = "It is 18 C and clear in Paris."
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER, TIME])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "It is 18 C and clear in Paris."
    assert not r.choices[0].message.tool_calls
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>18 C, clear</tool_response>" in prompt


def test_answers_that_are_not_calls_are_content_whole(tool_server):
    import openai

    url, engine = tool_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Hi"}]
    for answer in ("Hello! <tool_call is not how I greet.", "<tool_call>{broken json</tool_call>"):
        engine.answer = answer
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (answer, "stop")
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], stream=True))
        assert streamed == answer
        # tool_choice "none": the tools reach the template, the answer is not parsed
        engine.answer = HERMES_ANSWER
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none")
        assert r.choices[0].message.content == HERMES_ANSWER and not r.choices[0].message.tool_calls


@pytest.mark.slow
def test_tool_requests_the_server_cannot_serve_get_400(tool_server, smollm2_path):
    import asyncio

    from medusa_jax.convert.load import load_tokenizer
    from medusa_jax.serve.app import create_app

    url, engine = tool_server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    r = httpx.post(url + "/v1/chat/completions", json=dict(body, tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text
    r = httpx.post(url + "/v1/chat/completions", json=dict(body, tools=[{"type": "function", "function": {}}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name", r.text

    async def ask(app, payload):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=payload)

    plain = load_tokenizer(smollm2_path)  # SmolLM2's own template has no place for tools
    r = asyncio.run(ask(create_app(engine, plain, MODEL, tool_call_parser="hermes"), body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "no place for tools" in r.json()["error"]["message"]
    r = asyncio.run(ask(create_app(engine, plain, MODEL), dict(body, tool_choice="none")))
    assert r.status_code == 200, r.text  # tools not to be called, which the template cannot show: left out
    assert "get_weather" not in engine.tokenizer.decode(engine.prompts[-1])
    r = asyncio.run(ask(create_app(engine, engine.tokenizer, MODEL), body))  # started without a parser
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"], r.text
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        create_app(engine, plain, MODEL, tool_call_parser="xlam")
    with pytest.raises(ValueError, match="no place for tools"):
        render_chat(plain, body["messages"], tools=[WEATHER])


def test_serve_refuses_a_chat_template_file_it_cannot_use(tmp_path, capsys):
    from medusa_jax.cli.serve import main

    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    for path, message in ((tmp_path / "missing.jinja", "No such file"), (empty, "the file is empty")):
        with pytest.raises(SystemExit) as e:
            main(["--chat-template", str(path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"--chat-template {path}: " in err and message in err, err
    with pytest.raises(SystemExit):
        main(["--tool-call-parser", "xlam"])
    assert "invalid choice: 'xlam'" in capsys.readouterr().err


#: A Mistral-style template (tools before the last user turn); the answer's calls follow [TOOL_CALLS].
MISTRAL_TEMPLATE = """{{ bos_token }}{%- for message in messages %}
{%- if message.role == "user" %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]
{%- endif %}[INST]{{ message.content }}[/INST]{% else %}{{ message.content }}{{ eos_token }}{% endif %}
{%- endfor %}"""


@pytest.mark.slow
def test_mistral_markers_are_special_tokens_kept_for_the_parser(smollm2_path):
    """Mistral's [TOOL_CALLS] and [ARGS] are special tokens, which an answer's text leaves out: with the
    mistral parser the server keeps them in the text it parses (and sends a call's text as no content),
    so the calls come back, streamed or not; without tools they stay out of the answer as before."""
    import asyncio

    from medusa_jax.convert.load import load_tokenizer
    from medusa_jax.serve.app import create_app

    tokenizer = load_tokenizer(smollm2_path)
    tokenizer.add_tokens(["[TOOL_CALLS]", "[ARGS]"], special_tokens=True)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    engine = _ScriptedEngine(tokenizer)
    engine.cfg = type("cfg", (), {"vocab_size": len(tokenizer)})
    app = create_app(engine, tokenizer, MODEL, tool_call_parser="mistral")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}

    async def post(payload):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.post("/v1/chat/completions", json=payload)
        await asyncio.sleep(0.2)  # the scripted engine's last event lands before the loop closes
        return r

    def ask(payload):
        return asyncio.run(post(payload))

    for answer, content, calls in (
            ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Sure.",
             [("get_weather", {"city": "Paris"})]),
            ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', None, [("get_weather", {"city": "Oslo"})]),
            ("[TOOL_CALLS] no call after all", "[TOOL_CALLS] no call after all", [])):
        engine.answer = answer
        assert marker in tokenizer.encode(answer, add_special_tokens=False)
        msg = ask(body).json()["choices"][0]["message"]
        assert msg["content"] == content and [_fn(c) for c in msg.get("tool_calls") or ()] == calls
        assert all(len(c["id"]) == 9 for c in msg.get("tool_calls") or ())
        lines = ask(dict(body, stream=True)).text.splitlines()
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines if x.startswith("data: {")]
        streamed = "".join(d.get("content") or "" for d in deltas)
        assert streamed == (content or "")  # a broken call's answer whole, its marker too (nothing lost)
        assert [_fn(c) for d in deltas for c in d.get("tool_calls") or ()] == calls
    engine.answer = 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    plain = ask(dict(body, tool_choice="none")).json()["choices"][0]["message"]
    assert plain["content"] == 'Sure. [{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.slow
def test_a_prompt_being_scored_answers_at_once_on_shutdown_or_a_client_gone(smollm2_path):
    """An echo's scoring (seconds per chunk on a long prompt) is watched from the event loop: when the
    shutdown's grace runs out the request gets 503 server_shutdown at once (uvicorn cut it off with a
    bare 500 while a chunk ran past the grace), and a client that disconnects stops its scoring at
    the next chunk (it ran to the end, holding the queue behind it)."""
    import asyncio
    import concurrent.futures

    from medusa_jax.convert.load import load_tokenizer
    from medusa_jax.serve.echo import ClientGone, Echoer
    from medusa_jax.serve.protocol import Generation
    from medusa_jax.serve.text import TokenPieces

    class SlowEngine:  # 20 chunks of 3 s; it checks `stop` between chunks, as the real one does
        def __init__(self):
            self.chunks = 0

        def prompt_logprobs(self, ids, top, stop=None, keep=False):
            from medusa_jax.decoding.requests import EngineStopped
            for _ in range(20):
                if stop():
                    raise EngineStopped("stopped")
                time.sleep(3.0)
                self.chunks += 1
            return [None] * len(ids)

    tokenizer = load_tokenizer(smollm2_path)
    cancel = {"now": False}
    engine = SlowEngine()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    echoer = Echoer(engine, tokenizer, TokenPieces(tokenizer), pool, 128, cancelled=lambda: cancel["now"])
    gen = Generation(messages=None, prompts=[[1, 2, 3]], max_tokens=1, temperature=0.0, top_p=1.0, seed=0, stop=[],
                     stream=False, include_usage=False, model=MODEL, echo=True, logprobs=1)

    async def scored(after, what):
        async def gone():
            return what == "client" and time.monotonic() > t0 + after

        async def grace():
            await asyncio.sleep(after)
            cancel["now"] = what == "shutdown"
        task = asyncio.ensure_future(grace())
        try:
            await echoer.echoes(gen, [[1, 2, 3]], gone)
        finally:
            await task
    for what in ("shutdown", "client"):
        cancel["now"], engine.chunks = False, 0
        t0 = time.monotonic()
        if what == "shutdown":
            with pytest.raises(RequestError) as e:
                asyncio.run(scored(1.0, what))
            assert e.value.status == 503 and e.value.code == "server_shutdown"
        else:
            with pytest.raises(ClientGone):
                asyncio.run(scored(1.0, what))
        assert time.monotonic() - t0 < 2.5  # not at the end of the running chunk (3 s), nor of the scoring (60 s)
        time.sleep(3.5)
        assert engine.chunks <= 2 and echoer.scoring == 0  # the scoring stopped at its next chunk
    pool.shutdown()


def test_a_full_queue_refuses_an_echo_before_scoring_its_prompt(tool_server):
    """429 comes before an echo's scoring (a refused loglikelihood request spent a whole prefill),
    and the request after the queue empties is scored and served."""
    url, engine = tool_server
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "echo": True, "logprobs": 1}
    engine.answer, engine.scored = " Paris", 0
    engine.waiting = engine.queued = 1000
    try:
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert engine.scored == 0
    finally:
        engine.waiting = engine.queued = 0
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200 and engine.scored == 1
    assert r.json()["choices"][0]["text"].startswith("The capital of France is")


@pytest.mark.slow
def test_unknown_request_fields_are_ignored_with_a_warning_in_the_log(smollm2_path):
    """A field the server does not know is ignored, as vLLM ignores it (the answer is a 200 as if it
    were not sent), but the server's log names it, with the field it most likely misspells: a
    misspelt ``temprature`` does not pass unseen. OpenAI's bookkeeping fields (``user``) and known
    fields log nothing."""
    import asyncio
    import logging

    from medusa_jax.convert.load import load_tokenizer
    from medusa_jax.serve.app import create_app

    tokenizer = load_tokenizer(smollm2_path)
    engine = _ScriptedEngine(tokenizer)
    engine.answer = "Mars."
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("medusa_jax.serve")
    logger.addHandler(handler)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a planet."}], "max_tokens": 4,
            "user": "u-1", "temperature": 0}

    async def post(path, body):
        transport = httpx.ASGITransport(app=create_app(engine, tokenizer, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        assert asyncio.run(post("/v1/chat/completions", chat))["choices"][0]["message"]["content"] == "Mars."
        assert asyncio.run(post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "top_k": 5}))
        assert records == []
        body = dict(chat, temprature=0.7)
        assert asyncio.run(post("/v1/chat/completions", body))["choices"][0]["message"]["content"] == "Mars."
        asyncio.run(post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_token": 2, "frobnicate": 1}))
        asyncio.run(post("/tokenize", {"model": MODEL, "prompt": "Hi", "return_token_str": True}))
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "/v1/chat/completions: ignored the request's unknown field 'temprature' (did you mean 'temperature'?); the "
        "answer is as if it was not sent",
        "/v1/completions: ignored the request's unknown fields 'frobnicate', 'max_token' (did you mean "
        "'max_tokens'?); the answer is as if they were not sent",
        "/tokenize: ignored the request's unknown field 'return_token_str' (did you mean 'return_token_strs'?); the "
        "answer is as if it was not sent"]
    assert all(r.levelno == logging.WARNING for r in records)


def test_every_request_field_the_server_reads_is_known():
    """The lists of known fields (`protocol.CHAT_FIELDS`, `COMPLETION_FIELDS`) hold every field the
    request models declare and every field the server's modules read from a body themselves, so
    that a field the server honours is never logged as ignored."""
    import inspect
    import re

    from medusa_jax.serve import app, body, prompts, protocol, running, serving

    assert set(protocol.ChatCompletionRequest.model_fields) <= protocol.CHAT_FIELDS
    assert set(protocol.CompletionRequest.model_fields) <= protocol.COMPLETION_FIELDS
    source = "".join(inspect.getsource(m) for m in (protocol, app, body, prompts, running, serving))
    read = set(re.findall(r'body\.get\("(\w+)"|body\["(\w+)"\]|\(body, "(\w+)"', source))
    read = {name for names in read for name in names if name} - {"tokens", "return_token_strs"}  # (de)tokenize's
    assert read <= protocol.CHAT_FIELDS | protocol.COMPLETION_FIELDS, read - protocol.CHAT_FIELDS
    assert {"messages", "top_logprobs"} <= protocol.CHAT_FIELDS and "prompt" in protocol.COMPLETION_FIELDS
    assert "top_logprobs" not in protocol.COMPLETION_FIELDS  # a chat's field, which a completion refuses


@pytest.mark.slow
def test_tools_can_be_left_out_of_a_chat_with_tool_choice_none(smollm2_path):
    """--exclude-tools-when-tool-choice-none (vLLM's flag): a chat with tool_choice "none" is fed to
    the model without its tools; by default (vLLM's) and with "auto" the template shows them."""
    import asyncio

    from medusa_jax.convert.load import load_tokenizer
    from medusa_jax.serve.app import create_app

    tokenizer = load_tokenizer(smollm2_path)
    tokenizer.chat_template = HERMES_TEMPLATE
    engine = _ScriptedEngine(tokenizer)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]}

    def count(exclude, body):
        async def post():
            transport = httpx.ASGITransport(app=create_app(engine, tokenizer, MODEL, tool_call_parser="hermes",
                                                           exclude_tools_when_none=exclude))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                r = await client.post("/tokenize", json=body)
            assert r.status_code == 200, r.text
            return r.json()["count"]
        return asyncio.run(post())

    bare = count(False, chat)
    none = dict(chat, tools=[WEATHER], tool_choice="none")
    assert count(False, none) > bare and count(True, none) == bare
    auto = dict(chat, tools=[WEATHER], tool_choice="auto")
    assert count(True, auto) == count(False, auto) == count(False, none)
