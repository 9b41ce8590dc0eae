"""The OpenAI-compatible server, as a real process on 127.0.0.1 talked to by the official `openai`
client: greedy answers equal decode.py's; streamed chunks concatenate to the answer; 48 requests
from 16 concurrent streaming clients each get their own answer; a client that disconnects frees its
row; every bad request gets its 4xx and the server goes on; a conversation's second turn reuses the
first's cache and answers as without; the README's serving examples run; SIGTERM exits 0."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.real_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Count from one to ten.",
             "What is 12 times 7?", "Give me a synonym for happy.", "Name a planet of the solar system.",
             "Write a haiku about rain.", "What is the boiling point of water?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_path):
    port = free_port()
    bin_dir = os.path.dirname(sys.executable)
    proc = subprocess.Popen([os.path.join(bin_dir, "medusa-serve"), "--port", str(port), "--max-batch", "16",
                             "--max-waiting", "64", "--max-request-mb", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("the server did not answer /health within 900 s")
    yield url, proc
    # SIGTERM while a stream runs: the server takes no new request, lets the stream finish with its
    # final event, and exits 0
    lines, started = [], threading.Event()

    def streaming():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to twenty."}],
                "max_tokens": 48, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                started.set()
                lines.extend([line] if line else [])
        started.set()

    t = threading.Thread(target=streaming)
    t.start()
    assert started.wait(300)  # the stream is under way (a fixed sleep raced a loaded machine)
    proc.send_signal(signal.SIGTERM)
    t.join(300)
    assert proc.wait(timeout=120) == 0, proc.stdout.read()[-3000:]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert '"finish_reason": "' in lines[-2], lines[-2]


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def reference(smollm2):
    """decode.py's greedy text for each question (its --prompts-file path, the same engine)."""
    import medusa_jax as mj

    heads, tree, _ = mj.resolve_heads(smollm2, None)
    out = {}
    for q in QUESTIONS:
        ids = mj.apply_chat_template(smollm2.tokenizer, q)
        r = mj.generate(smollm2.cfg, smollm2.params, ids, heads=heads, tree=tree, max_new_tokens=48, progress=False)
        out[q] = smollm2.tokenizer.decode(r.tokens, skip_special_tokens=True)
    return out


def ask(client, q, stream=False, **kw):
    msgs = [{"role": "user", "content": q}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0, stream=stream, **kw)
    if not stream:
        return r.choices[0].message.content, r
    return "".join(c.choices[0].delta.content or "" for c in r if c.choices), None


def test_greedy_answers_equal_decode_py_streamed_or_not(client, reference, tmp_path):
    decoded = subprocess.run([sys.executable, "decode.py", "--prompt", QUESTIONS[0], "--max-new-tokens", "48", "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert decoded.returncode == 0, decoded.stderr[-2000:]
    assert json.loads(decoded.stdout)["text"] == reference[QUESTIONS[0]]
    for q in QUESTIONS[:3]:
        text, r = ask(client, q)
        assert text == reference[q]
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
        spec = r.model_extra["speculation"]
        assert spec["steps"] >= 1 and spec["tokens_per_step"] >= 1.0
        assert ask(client, q, stream=True)[0] == text


def test_48_requests_from_16_concurrent_streaming_clients(client, reference):
    results, errors = {}, []

    def worker(w):
        try:
            for k in range(3):
                q = QUESTIONS[(w + k) % len(QUESTIONS)]
                results[(w, k)] = (q, ask(client, q, stream=True)[0])
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    t0 = time.time()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors, errors
    assert len(results) == 48 and time.time() - t0 < 900
    for (w, k), (q, text) in results.items():
        assert text == reference[q], (w, k, q)


def test_a_client_that_disconnects_frees_its_row(client, server):
    url = server[0]
    before = cancelled(url)
    others = []
    t = threading.Thread(target=lambda: others.extend(ask(client, q)[0] for q in QUESTIONS[:2]))
    t.start()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
            "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks += 1
            if chunks >= 3:
                break
    t.join(600)
    assert len(others) == 2
    deadline = time.time() + 60
    while cancelled(url) <= before and time.time() < deadline:
        time.sleep(0.5)
    assert cancelled(url) == before + 1
    assert ask(client, QUESTIONS[3])[0]  # the row is free again
    assert httpx.get(url + "/health").json()["running"] == 0


def test_a_non_streaming_client_that_disconnects_frees_its_row(server):
    """A client that gives up on a non-streaming answer (its own timeout) ends the request: its
    row is freed within seconds, not after the rest of its max_tokens."""
    url = server[0]
    before = cancelled(url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long essay about Rome."}],
            "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=3)
    deadline = time.time() + 20
    while cancelled(url) <= before and time.time() < deadline:
        time.sleep(0.5)
    assert cancelled(url) == before + 1
    assert httpx.get(url + "/health").json()["running"] == 0


def cancelled(url) -> float:
    m = re.search(r'vllm:request_success_total\{finished_reason="abort"[^}]*\} (\S+)', httpx.get(url + "/metrics").text)
    return float(m.group(1))


BAD = [
    ("not JSON", b"{nope", 400),
    ("unknown model", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("empty messages", {"model": MODEL, "messages": []}, 400),
    ("unknown role", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("content not a string", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ("negative max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400),
    ("huge max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 9}, 400),
    ("max_tokens a string", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, 400),
    ("n > 128", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 129}, 400),
    ("n beyond the rows and the queue", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 81}, 400),
    ("n = 0", {"model": MODEL, "prompt": "x", "n": 0}, 400),
    ("tools", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400),
    ("prompt beyond the context", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400),
    ("temperature a string", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
    ("completions without a prompt", {"model": MODEL}, 400),
    ("completions prompt not valid Unicode", b'{"model": "%s", "prompt": "abc \\ud800x", "max_tokens": 4}' % MODEL.encode(),
     400),
    ("JSON nested too deeply", b"[" * 100000 + b"]" * 100000, 400),
    ("frequency_penalty a string", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                    "frequency_penalty": "abc"}, 400),
    ("prompt far beyond the context (refused before it is tokenized whole)",
     {"model": MODEL, "messages": [{"role": "user", "content": "ab " * 200000}]}, 400),
    ("stream_options without stream", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                       "stream_options": {"include_usage": True}}, 400),
    ("body over --max-request-mb", b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"word " * 300000), 413),
    ("image content part", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400),
    ("vLLM's use_beam_search (not honoured, so refused)", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                           "use_beam_search": True}, 400),
    ("completions min_tokens above max_tokens's default", {"model": MODEL, "prompt": "x", "min_tokens": 17}, 400),
    ("top_k below -1", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_k": -5}, 400),
    ("continue_final_message after a user message", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                      "continue_final_message": True,
                                                      "add_generation_prompt": False}, 400),
]


@pytest.mark.parametrize("what,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_4xx_and_the_server_goes_on(server, client, what, body, status):
    url = server[0]
    path = "/v1/completions" if what.startswith("completions") else "/v1/chat/completions"
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, timeout=600, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if "Unicode" in what:
        assert err["param"] == "prompt" and "not valid Unicode" in err["message"], err
    if "max-request-mb" in what:
        assert err["code"] == "request_too_large" and str(1 << 20) in err["message"], err
    if "frequency_penalty" in what:
        assert err["param"] == "frequency_penalty" and "must be a number" in err["message"], err
    if "far beyond" in what:
        assert err["code"] == "context_length_exceeded" and "from its first" in err["message"], err
    if "vLLM" in what:
        assert err["code"] == "unsupported_parameter" and err["param"] == "use_beam_search", err
    if "min_tokens" in what:
        assert err["param"] == "min_tokens" and "at most max_tokens (16, its default here)" in err["message"], err
    if "top_k" in what:
        assert err["param"] == "top_k" and "at least 1" in err["message"], err
    if "stream_options" in what:
        assert err["param"] == "stream_options" and "only allowed when stream is true" in err["message"], err
    good = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert good.choices[0].message.content


def test_second_turn_reuses_the_first_and_answers_as_without(client, smollm2):
    import medusa_jax as mj
    from medusa_jax.chat import render_chat

    msgs = [{"role": "user", "content": "My favourite fruit is the mango. Describe it in one sentence."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Which fruit did I say was my favourite?"}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    assert second.model_extra["speculation"]["prompt_tokens_reused"] > first.usage.prompt_tokens // 2
    heads, tree, _ = mj.resolve_heads(smollm2, None)
    ids = render_chat(smollm2.tokenizer, msgs)
    alone = mj.generate(smollm2.cfg, smollm2.params, ids, heads=heads, tree=tree, max_new_tokens=40, progress=False)
    assert second.choices[0].message.content == smollm2.tokenizer.decode(alone.tokens, skip_special_tokens=True)


def test_content_parts_and_developer_role_answer_as_plain_strings(client):
    """OpenAI's list-of-text-parts content and "developer" role (what newer clients send) give the
    answer of the same chat as strings and a "system" message."""
    parts = [{"role": "developer", "content": "Answer in one short sentence."},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of Italy?"}]}]
    plain = [{"role": "system", "content": "Answer in one short sentence."},
             {"role": "user", "content": "What is the capital\nof Italy?"}]
    a, b = (client.chat.completions.create(model=MODEL, messages=m, max_tokens=16, temperature=0) for m in (parts, plain))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_completions_stop_sequences_and_models(client, server):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0,
                                  stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text
    # more than OpenAI's 4 stop sequences, as vLLM takes them (lm-evaluation-harness's "until" lists)
    many = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0,
                                     stop=["\n\n", "Question:", "</s>", "<|im_end|>", "zzz", "."])
    assert many.choices[0].text == r.choices[0].text and many.choices[0].finish_reason == "stop"
    too_many = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["a"] * 65})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "stop"
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    missing = httpx.get(server[0] + "/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    metrics = httpx.get(server[0] + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
                 "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert name in metrics, name

    def counter(name):
        return float(re.search(rf"^{name}_total{{[^}}]*}} (\S+)$", metrics, flags=re.M).group(1))

    # vLLM's hit rate: hits / queries, both in prompt tokens (every prompt token is looked up)
    assert counter("vllm:prefix_cache_queries") == counter("vllm:prompt_tokens") > 0
    assert 0 <= counter("vllm:prefix_cache_hits") <= counter("vllm:prefix_cache_queries")
    assert counter("vllm:num_preemptions") == 0

    def hist(name, part):
        return float(re.search(rf"^{name}_{part}{{[^}}]*}} (\S+)$", metrics, flags=re.M).group(1))

    # each finished request's tokens and times (its tokens are among the engine's counted ones)
    assert 0 < hist("vllm:request_generation_tokens", "sum") <= counter("vllm:generation_tokens")
    assert 0 < hist("vllm:request_prompt_tokens", "sum") <= counter("vllm:prompt_tokens")
    assert hist("vllm:request_prompt_tokens", "count") == hist("vllm:request_decode_time_seconds", "count") > 0
    assert hist("vllm:request_prefill_time_seconds", "sum") > 0
    assert hist("vllm:request_queue_time_seconds", "count") == hist("vllm:request_prefill_time_seconds", "count")
    assert 0.0 <= float(re.search(r"^vllm:kv_cache_usage_perc{[^}]*} (\S+)$", metrics, flags=re.M).group(1)) <= 1.0
    # without max_tokens a completion gets OpenAI's and vLLM's 16 tokens (a chat: the rest of the context)
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (16, "length"), r


def test_completions_take_token_ids_and_several_prompts(client, server, smollm2):
    """A completion's prompt as token ids (OpenAI's and vLLM's list of ints, or a list of one such
    list) answers as its text does; several prompts in one request (texts and token-id lists) give
    choice k * n + j for prompt k's j-th, each the answer it gets alone, and usage counts every
    prompt once; a bad prompt among several, or an id outside the vocabulary, gets a 400 naming it."""
    text = "Count: 1, 2, 3,"
    ids = list(smollm2.tokenizer.encode(text))
    want = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    for prompt in (ids, [ids]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert (r.choices[0].text, r.usage.prompt_tokens) == (want.choices[0].text, len(ids))
    other = "The colours of the rainbow are"
    alone = client.completions.create(model=MODEL, prompt=other, max_tokens=8, temperature=0).choices[0].text
    r = client.completions.create(model=MODEL, prompt=[other, ids], max_tokens=8, temperature=0, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, alone), (1, alone), (2, want.choices[0].text),
                                                      (3, want.choices[0].text)]
    assert r.usage.prompt_tokens == len(smollm2.tokenizer.encode(other)) + len(ids)
    assert r.usage.completion_tokens == 4 * 8
    chunks = list(client.completions.create(model=MODEL, prompt=[other, text], max_tokens=8, temperature=0,
                                            stream=True))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts == [alone, want.choices[0].text]
    for prompt, message in ((["a", ""], "prompt 1 is empty"), ([ids, [5, 10 ** 6]], "prompt 1: token id 1000000"),
                            ([1, 10 ** 6], "token id 1000000 is outside the model's vocabulary"),
                            ([[]], "must be a string or a list of token ids, got an empty list"),
                            (["a"] * 129, "at most 128 prompts")):
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt"


def test_echo_gives_the_prompt_and_its_logprobs_as_lm_eval_asks(client, server, smollm2, smollm2_hf):
    """What lm-evaluation-harness's loglikelihood tasks send (``echo``, ``logprobs: 1``, ``max_tokens``
    1, token-id prompts, several per request): each choice's text is the prompt and its answer, and
    its token_logprobs are the prompt tokens' own log-probabilities under the model (the first
    null), equal to one forward of transformers' model, then the answer's; ``max_tokens: 0`` answers
    the prompts alone; streamed, the prompt comes first; without echo, max_tokens 0 is a 400."""
    import numpy as np
    import torch

    tok = smollm2.tokenizer
    context, continuation = "The capital of France is", " Paris"
    ids = list(tok.encode(context + continuation))
    other = list(tok.encode("One, two, three, four"))
    r = client.completions.create(model=MODEL, prompt=[ids, other], max_tokens=1, temperature=0, logprobs=1, echo=True)
    plain = client.completions.create(model=MODEL, prompt=[ids, other], max_tokens=1, temperature=0)
    for c, p, q in zip(r.choices, (ids, other), plain.choices):
        lp = c.logprobs
        assert c.text == tok.decode(p) + q.text and len(lp.tokens) == len(p) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    from tests.conftest import torch_logits
    logits = torch.log_softmax(torch.as_tensor(torch_logits(smollm2_hf, [ids])[0]).double(), -1).numpy()
    want = logits[np.arange(len(ids) - 1), ids[1:]]
    got = np.array(r.choices[0].logprobs.token_logprobs[1:len(ids)])
    np.testing.assert_allclose(got, want, atol=2e-3)
    # lm-eval's sum over the continuation and its is-greedy test (the tokens after the context)
    n_ctx = len(tok.encode(context))
    lp = r.choices[0].logprobs
    assert abs(sum(lp.token_logprobs[n_ctx:-1]) - want[n_ctx - 1:].sum()) < 5e-3
    greedy = all(x == max(d.values()) for x, d in zip(lp.token_logprobs[n_ctx:-1], lp.top_logprobs[n_ctx:-1]))
    assert greedy == all(logits[j - 1].argmax() == ids[j] for j in range(n_ctx, len(ids)))
    # the scoring's KV cache is kept for the answer's prefill: a loglikelihood request of a prompt
    # longer than the prefix cache's minimum prefills its last token only
    long_ids = list(tok.encode("Loglikelihood of: " + " ".join(QUESTIONS)))
    assert len(long_ids) > 20
    ll = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert ll.model_extra["speculation"]["prompt_tokens_reused"] == len(long_ids) - 1
    # max_tokens 0: the prompts alone (text as given), the same figures
    alone = client.completions.create(model=MODEL, prompt=[context + continuation, other], max_tokens=0, n=2,
                                      logprobs=1, echo=True)
    assert [c.index for c in alone.choices] == [0, 1, 2, 3]
    assert [c.finish_reason for c in alone.choices] == ["length"] * 4
    assert alone.choices[0].text == context + continuation and alone.usage.completion_tokens == 0
    assert alone.usage.prompt_tokens == len(ids) + len(other)
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    streamed = list(client.completions.create(model=MODEL, prompt=context, max_tokens=6, temperature=0, echo=True,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    answer = client.completions.create(model=MODEL, prompt=context, max_tokens=6, temperature=0).choices[0].text
    assert streamed[0].choices[0].text == context and text == context + answer
    assert streamed[-1].usage.prompt_tokens == n_ctx
    # special tokens written in a text prompt stay in its echo, and text_offset indexes the echoed text;
    # the same prompt as token ids echoes the same text with the same offsets
    special = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    by_text = client.completions.create(model=MODEL, prompt=special, max_tokens=2, temperature=0, logprobs=1,
                                        echo=True).choices[0]
    by_ids = client.completions.create(model=MODEL, prompt=list(tok.encode(special)), max_tokens=2, temperature=0,
                                       logprobs=1, echo=True).choices[0]
    assert by_text.text.startswith(special) and by_ids.text == by_text.text
    assert by_ids.logprobs.text_offset == by_text.logprobs.text_offset
    assert all(by_text.text[o:].startswith(t) for o, t in zip(by_text.logprobs.text_offset, by_text.logprobs.tokens))
    assert by_text.logprobs.text_offset[1] == len("<|im_start|>")
    # echo alone needs no room for an answer: a prompt as long as the context is echoed
    full = [ids[0]] * server_context(server)
    whole = httpx.post(server[0] + "/v1/completions", json={"prompt": full, "max_tokens": 0, "echo": True}).json()
    assert whole["usage"]["prompt_tokens"] == len(full) and whole["choices"][0]["finish_reason"] == "length"
    over = httpx.post(server[0] + "/v1/completions", json={"prompt": full + full[:1], "max_tokens": 0, "echo": True})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    assert (f"the prompt has {len(full) + 1} tokens but the model's context (max_position_embeddings) holds "
            f"{len(full)} positions: shorten it") in over.json()["error"]["message"]
    for body, field, message in (({"prompt": "x", "max_tokens": 0}, "max_tokens", "0 only with echo"),
                                 ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo",
                                  "not supported")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        e = httpx.post(server[0] + path, json=dict(body, model=MODEL))
        assert e.status_code == 400 and message in e.json()["error"]["message"] and e.json()["error"]["param"] == field


def test_tokenize_and_detokenize_as_vllm(client, server, smollm2):
    """vLLM's /tokenize counts a prompt (the tokenizer's ids) or a chat (the ids a chat request is
    prefilled with: its usage's prompt_tokens), past the context too; /detokenize gives the text
    back; bad bodies get a 400 naming the field."""
    tok, url = smollm2.tokenizer, server[0]
    text = "The capital of France is"
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == list(tok.encode(text)) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert "".join(r["token_strs"]) == text
    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    chat = httpx.post(url + "/tokenize", json={"messages": msgs}).json()
    used = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0).usage
    assert chat["count"] == used.prompt_tokens and "token_strs" not in chat
    long = httpx.post(url + "/tokenize", json={"prompt": "hello " * (r["max_model_len"] + 10)}).json()
    assert long["count"] > long["max_model_len"]
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json()
    assert back["prompt"] == tok.decode(chat["tokens"], skip_special_tokens=False) and "<|im_start|>" in back["prompt"]
    for path, body, param in (("/tokenize", {"prompt": ["a", "b"]}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "x"}]}, "messages[0].role"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {}, "tokens"),
                              ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs")):
        e = httpx.post(url + path, json=body)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, (path, body, e.text)


def server_context(server) -> int:
    return httpx.get(server[0] + "/v1/models").json()["data"][0]["max_model_len"]


def readme_serving_blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M), re.findall(r"^```py\n(.*?)^```", text,
                                                                                flags=re.S | re.M)


def test_readme_serving_examples_run_as_written(server):
    port = server[0].rsplit(":", 1)[1]
    shell, python = readme_serving_blocks()
    assert shell and python
    for block in shell:
        out = subprocess.run(["bash", "-c", block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["choices"][0]["message"]["content"]
    for block in python:
        out = subprocess.run([sys.executable, "-c", block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()


def test_text_stream_stops_at_the_earliest_stop_sequence_however_the_tokens_arrive(smollm2):
    """The answer a list of stop sequences leaves, and its token count, do not depend on how many
    tokens a step delivered (plain decoding: one; a Medusa step: several)."""
    from medusa_jax.serve.text import TextStream

    tok = smollm2.tokenizer
    ids = tok.encode("1. 1\n2. 2\n3. 3\n4. 4\n5. 5")
    first = next(n for n in range(1, len(ids) + 1)
                 if "2\n3" in tok.decode(ids[:n], skip_special_tokens=True))
    for stop in (["\n3.", "2\n3"], ["2\n3", "\n3."], ["\n3.", "2\n3", "4"]):
        for size in (1, 2, 3, 5, len(ids)):
            ts, deltas, stopped = TextStream(tok, stop), [], False
            for i in range(0, len(ids), size):
                delta, stopped = ts.feed(ids[i:i + size])
                deltas.append(delta)
                if stopped:
                    break
            assert stopped and ts.text == "".join(deltas) == "1. 1\n2. ", (stop, size, ts.text)
            assert ts.used == first, (stop, size)


def _fed(ts, ids, size):
    """Feed `ids` to a TextStream `size` tokens at a time until it stops: (the text handed out, stopped)."""
    out, stopped = "", False
    for i in range(0, len(ids), size):
        delta, stopped = ts.feed(ids[i:i + size])
        out += delta
        if stopped:
            break
    return out, stopped


def test_a_completion_decoded_after_its_prompt_is_the_same_text_on_a_byte_level_vocabulary(smollm2):
    """`TextStream(after=)` (a completion's answer decoded after its prompt's last tokens, for
    SentencePiece's first space) changes nothing on a byte-level vocabulary, also when the prompt
    ends inside a character that the answer finishes (those bytes would be read as one U+FFFD)."""
    from medusa_jax.serve.text import TextStream

    tok = smollm2.tokenizer
    dna = tok.encode("Hi \U0001F9EC Paris", add_special_tokens=False)  # the emoji in three tokens
    assert [tok.decode(dna[:n]) for n in (2, 3, 4)] == ["Hi \ufffd", "Hi \ufffd", "Hi \U0001F9EC"]
    for prompt, answer in ((tok.encode("The capital of France is"), tok.encode(" Paris, 東京 and 🙂.")),
                           (dna[:2], dna[2:]), (dna[:1], dna[1:]),
                           (dna[:2], dna[2:3] + dna[4:])):  # an answer that does not finish the character
        for size in (1, 2, len(answer)):
            alone, after = TextStream(tok, []), TextStream(tok, [], after=prompt[-6:])
            pieces = [(alone.feed(answer[i:i + size]), after.feed(answer[i:i + size]))
                      for i in range(0, len(answer), size)]
            assert all(a == b for a, b in pieces), (prompt, size, pieces)
            assert alone.feed([], final=True) == after.feed([], final=True)
            assert after.text == tok.decode(answer), after.text


def test_text_stream_ignores_stops_completed_within_min_tokens(smollm2):
    """min_tokens (vLLM's): a stop sequence completed by one of the first min_tokens tokens does not
    end the answer (the same stop later does), however many tokens each step delivered."""
    from medusa_jax.serve.text import TextStream

    tok = smollm2.tokenizer
    ids = tok.encode("1. 1\n2. 2\n3. 3\n4. 4\n5. 5")
    ends = [n for n in range(1, len(ids) + 1) if tok.decode(ids[:n]).count("\n") > tok.decode(ids[:n - 1]).count("\n")]
    for min_tokens, want in ((0, "1. 1"), (ends[0] - 1, "1. 1"), (ends[0], "1. 1\n2. 2"), (ends[1], "1. 1\n2. 2\n3. 3")):
        for size in (1, 3, len(ids)):
            ts = TextStream(tok, ["\n"], min_tokens=min_tokens)
            out, stopped = _fed(ts, ids, size)
            assert stopped and out == ts.text == want, (min_tokens, size, out)


def test_text_stream_leaves_out_a_character_the_answer_ended_inside(smollm2):
    """An answer cut (max_tokens) between the tokens of one character ends before it: no U+FFFD,
    streamed or not; complete, the character is there."""
    from medusa_jax.serve.text import TextStream

    tok = smollm2.tokenizer
    ids = tok.encode("Party 🎉 time", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    ts = TextStream(tok, [])
    streamed = ts.feed(ids[:cut])[0] + ts.feed([], final=True)[0]
    assert streamed == ts.text == tok.decode(ids[:cut]).rstrip("\ufffd") and "\ufffd" not in streamed
    whole = TextStream(tok, [])
    assert whole.feed(ids)[0] + whole.feed([], final=True)[0] == "Party 🎉 time"


def test_text_stream_stop_sequences_match_whole_characters_and_can_be_kept(smollm2):
    """A stop of U+FFFD is not found in a character whose bytes are still coming (vLLM holds such
    text back too); with include_stop (vLLM's include_stop_str_in_output) the text ends after the
    stop instead of before it, the token count the same."""
    from medusa_jax.serve.text import TextStream

    tok = smollm2.tokenizer
    ids = tok.encode("Fish 🐟🐠🐬 and more", add_special_tokens=False)
    for size in (1, 2, len(ids)):
        ts, out, stopped = TextStream(tok, ["\ufffd"]), "", False
        for i in range(0, len(ids), size):
            delta, stopped = ts.feed(ids[i:i + size])
            out += delta
            assert not stopped, size
        assert out + ts.feed([], final=True)[0] == "Fish 🐟🐠🐬 and more"
    for include, want in ((False, "Fish 🐟"), (True, "Fish 🐟🐠")):
        for size in (1, 3):
            ts = TextStream(tok, ["🐠", "🐬"], include_stop=include)
            out, stopped = _fed(ts, ids, size)
            assert stopped and out == ts.text == want, (include, size, out)
            assert tok.decode(ids[:ts.used]).startswith("Fish 🐟🐠") and not \
                tok.decode(ids[:ts.used - 1]).startswith("Fish 🐟🐠")


def test_text_stream_picks_the_stop_one_token_at_a_time_would_and_hides_stop_tokens(smollm2):
    """The stop that ends the text is the one whose last character comes first (the first of the
    list among those the same token completes), as vLLM finds them token by token, whether the
    tokens come one at a time or all at once; `used` counts the tokens up to it. A stop token's text
    is left out unless include_stop (vLLM's)."""
    from medusa_jax.serve.text import TextStream

    tok = smollm2.tokenizer
    text = "The abc of it: xyz. Done."
    ids = tok.encode(text, add_special_tokens=False)
    for stops, include, want in (([" xyz", "y"], True, "The abc of it: xy"), ([" xyz", "y"], False, "The abc of it: x"),
                                 (["xyz.", "xyz"], True, "The abc of it: xyz"), (["yz", "abc"], False, "The ")):
        got = set()
        for size in (1, 2, len(ids)):
            ts, out = TextStream(tok, stops, include_stop=include), ""
            for i in range(0, len(ids), size):
                delta, stopped = ts.feed(ids[i:i + size])
                out += delta
                if stopped:
                    break
            assert stopped and out == ts.text, (stops, size)
            got.add((ts.text, ts.used))
        (cut, used), = got  # the same text and count however the tokens came
        assert cut == want, (stops, include, cut)
        # used: the first token whose text completes a stop
        assert any(s in tok.decode(ids[:used]) for s in stops) and not any(s in tok.decode(ids[:used - 1]) for s in stops)
    for include in (False, True):  # the engine ends an answer at a stop token: ids[3] here
        ts = TextStream(tok, [], include_stop=include, hidden_ids=[ids[3]])
        streamed = ts.feed(ids[:4])[0] + ts.feed([], final=True)[0]
        assert streamed == ts.text == tok.decode(ids[:4] if include else ids[:3]), (include, ts.text)


def test_sampling_without_a_seed_differs_between_requests_and_a_seed_repeats(client):
    """OpenAI's behaviour: each unseeded request samples on its own; the same seed, the same answer."""
    msgs = [{"role": "user", "content": "Tell me a short story about a cat."}]

    def ask(**kw):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, **kw)
        return r.choices[0].message.content

    assert len({ask() for _ in range(4)}) > 1
    assert ask(seed=7) == ask(seed=7)


def test_top_k_samples_as_plain_sampling_does(client, smollm2):
    """vLLM's top_k: the server's Medusa answer (exact acceptance) is plain top-k sampling's, token for
    token, for the same seed; without top_k the same seed at this temperature answers otherwise."""
    import medusa_jax as mj
    from medusa_jax.chat import render_chat

    msgs = [{"role": "user", "content": "Name three colours."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=2.0, seed=5)
    top2 = client.chat.completions.create(**kw, extra_body={"top_k": 2}).choices[0].message.content
    plain = mj.generate(smollm2.cfg, smollm2.params, render_chat(smollm2.tokenizer, msgs), max_new_tokens=24,
                        acceptance=mj.Acceptance(temperature=2.0, top_k=2), seed=5, progress=False)
    assert top2 == smollm2.tokenizer.decode(plain.tokens, skip_special_tokens=True)
    assert client.chat.completions.create(**kw).choices[0].message.content != top2


def test_405_says_which_methods_are_allowed_and_stop_counts_tokens_to_the_stop(client, server):
    r = httpx.get(server[0] + "/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers.get("allow", ""), r.headers
    assert r.json()["error"]["message"]
    r = httpx.post(server[0] + "/v1/chat/completion", json={})  # a typo: OpenAI's 404 body
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith("Invalid URL (POST /v1/chat/completion)")
    for path in ("/health", "/v1/models", "/metrics"):  # HEAD, as health probes send it
        assert httpx.head(server[0] + path).status_code == 200, path
    assert httpx.get(server[0] + "/docs").status_code == 404  # no docs page (it would load a CDN's scripts)

    def complete(**kw):
        return client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, **kw)

    text = complete(max_tokens=24).choices[0].text
    stop = text.strip()[:3]  # a stop sequence that the answer's first tokens complete
    cut = complete(max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.find(stop)]
    # completion_tokens: the tokens up to the one that completed the stop (greedy: the first k of
    # the full answer), not those the engine made after it
    k = next(k for k in range(1, 25) if stop in complete(max_tokens=k).choices[0].text)
    assert cut.usage.completion_tokens == k


@pytest.mark.server
def test_requests_past_the_shutdown_grace_get_the_shutdown_error(smollm2_path):
    """SIGTERM with --shutdown-grace 4 while two long requests run: shortly before the grace ends
    they end with the server_shutdown error (a 503 body; an SSE error event, then [DONE]) instead of
    uvicorn cutting them off (a bare 500, a broken stream); the process exits 0. (No prefix cache: a
    retired row's snapshot of a new length compiles, which the engine cannot interrupt.)"""
    port = free_port()
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "medusa-serve"), "--port", str(port),
                             "--shutdown-grace", "4", "--prefix-cache-mb", "0", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        # a raw count goes on past the grace (no end-of-turn to stop it): 1,000 tokens take at least 6 s
        # at this CPU's 150 tokens/s for one row alone, where the requests end 3 s after they start (1 s,
        # then the grace of 4 s less its margin of 2 s)
        body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 1000, "temperature": 0}
        got = {}

        def plain():
            got["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=300)

        def streaming():
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
                got["stream"] = [line for line in r.iter_lines() if line]

        def warm_up():  # the same shapes compiled first, every cache size the count grows through included:
            # the engine cannot be interrupted while it compiles (a new size's compile near the grace's end
            # left the request to uvicorn's bare 500)
            httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()

        warm = [threading.Thread(target=warm_up) for _ in range(2)]
        for t in warm:
            t.start()
        for t in warm:
            t.join(600)
        threads = [threading.Thread(target=plain), threading.Thread(target=streaming)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert proc.wait(timeout=60) == 0
        r = got["plain"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown", r.text
        lines = got["stream"]
        assert lines[-1] == "data: [DONE]" and '"server_shutdown"' in lines[-2], lines[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()


class _CompilingEngine:
    """An engine stuck in a compile: requests are taken, but no token or end comes out, and
    `cancel_all` only marks them (the real engine acts on it at its next iteration)."""
    max_len, max_batch, queued, live, waiting, stats, eos = 512, 4, 0, 0, 0, {}, (0,)

    class cfg:
        vocab_size = 100

    def __init__(self):
        from medusa_jax.decoding.requests import RequestHandle
        self.handles, self._handle = [], RequestHandle

    def submit(self, request, on_event=None):
        self.handles.append(self._handle(request, on_event))
        return self.handles[-1]

    def cancel_all(self):
        for h in self.handles:
            h.cancel()

    def start(self):
        pass

    def stop(self, cancel=True, timeout=None):
        pass


class _Tokenizer:
    def encode(self, text):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)


def test_the_grace_end_answers_requests_while_the_engine_is_compiling():
    """At the end of the shutdown grace (`begin_shutdown(cancel=True)`), a request whose engine is
    busy (compiling a new shape, which cannot be interrupted) still gets the server_shutdown error at
    once (a 503 body; an SSE error event, then [DONE]), not uvicorn's bare 500 at the deadline."""
    import asyncio

    from medusa_jax.serve.app import create_app

    engine = _CompilingEngine()
    app = create_app(engine, _Tokenizer(), MODEL)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 50}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            plain = asyncio.create_task(client.post("/v1/completions", json=body))
            streamed = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": True}))
            for _ in range(1000):  # both submitted (a request that failed instead would never be)
                if len(engine.handles) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(engine.handles) == 2, [t.result().text for t in (plain, streamed) if t.done()]
            await asyncio.sleep(0.2)
            assert not plain.done()  # nothing comes out of the engine
            app.state.begin_shutdown(cancel=True)
            return await asyncio.wait_for(asyncio.gather(plain, streamed), timeout=10)

    plain, streamed = asyncio.run(main())
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutdown", plain.text
    lines = [line for line in streamed.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and '"server_shutdown"' in lines[-2], lines[-3:]
    assert all(h.cancelled.is_set() for h in engine.handles)  # and the engine frees their rows when it can


def test_a_body_is_answered_for_its_first_field_at_fault():
    """The request models (`protocol.ChatCompletionRequest`, `CompletionRequest`) check their fields
    in the order the server always has: a body at fault in several fields is answered for the
    first (the model before the unsupported fields, those before the others); a missing
    ``messages`` is named; a field sent as null is taken as absent."""
    from medusa_jax.serve.protocol import RequestError, check_request

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for extra, param in (({"temperature": 5, "n": 0}, "n"), ({"model": "other", "best_of": 2}, "model"),
                         ({"best_of": 2, "temperature": 5}, "best_of"),
                         ({"allowed_token_ids": [], "bad_words": 5}, "bad_words"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"max_completion_tokens": 0, "max_tokens": "x"}, "max_tokens"),
                         ({"continue_final_message": True}, "add_generation_prompt"),
                         ({"stream": True, "stream_options": {"include_usage": None}}, "stream_options.include_usage")):
        with pytest.raises(RequestError) as e:
            check_request(dict(chat, **extra), [MODEL], 64, True)
        assert e.value.param == param, (extra, e.value)
    with pytest.raises(RequestError, match="^messages is required$"):
        check_request({"model": MODEL}, [MODEL], 64, True)
    gen = check_request(dict(chat, temperature=None, n=None, stop=None, stream_options=None), [MODEL], 64, True)
    assert (gen.temperature, gen.n, gen.stop, gen.include_usage) == (1.0, 1, [], False)
    with pytest.raises(RequestError, match="^prompt must be a string or a list of token ids, got NoneType$"):
        check_request({"prompt": None}, [MODEL], 64, False)


def test_top_p_is_refused_with_one_interval_whatever_side_it_misses():
    from medusa_jax.serve.protocol import RequestError, check_request

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for bad in (0, 0.0, -0.5, 1.5):
        with pytest.raises(RequestError, match=r"top_p must be in \(0, 1\], got"):
            check_request(dict(body, top_p=bad), [MODEL], 64, True)
    assert check_request(dict(body, top_p=1), [MODEL], 64, True).top_p == 1.0


def test_logprobs_are_the_models_own_streamed_or_not(client, server, smollm2):
    """logprobs with the openai client: a greedy chat's tokens spell its answer, each token is its
    position's most likely one, and its log-probability and top_logprobs equal one forward of the
    backbone over the prompt and the answer (Medusa's steps change nothing beyond round-off); the
    streamed chunks carry the same entries; a completion's legacy object (tokens, token_logprobs,
    top_logprobs, text_offset) matches too, cut where a stop sequence ended the text."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import medusa_jax as mj
    from medusa_jax.models.llama import LlamaModel

    tok = smollm2.tokenizer

    def reference(prompt_ids, answer_ids):
        ids = jnp.asarray([list(prompt_ids) + list(answer_ids)], jnp.int32)
        logits = LlamaModel(smollm2.cfg).apply({"params": smollm2.params}, ids, jnp.arange(ids.shape[1])[None])[0][0]
        return np.asarray(jax.nn.log_softmax(logits[len(prompt_ids) - 1:-1].astype(jnp.float32), axis=-1))

    q = QUESTIONS[2]
    text, r = ask(client, q, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    prompt_ids = mj.apply_chat_template(tok, q)
    ids = mj.generate(smollm2.cfg, smollm2.params, prompt_ids, max_new_tokens=48, progress=False).tokens  # plain
    assert [c.token for c in content] == [tok.decode([t]) for t in ids] and len(ids) == r.usage.completion_tokens
    assert "".join(c.token for c in content).replace("<|im_end|>", "") == text
    ref = reference(prompt_ids, ids)
    for j, c in enumerate(content):
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy: the most likely
        assert abs(c.logprob - ref[j, ids[j]]) < 2e-3 and c.bytes == list(c.token.encode())
        best = np.argsort(-ref[j])[:3]
        np.testing.assert_allclose([t.logprob for t in c.top_logprobs], ref[j, best], atol=2e-3)
    streamed = [c.choices[0] for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=48, temperature=0, stream=True,
        logprobs=True, top_logprobs=3) if c.choices]
    entries = [e for ch in streamed if ch.logprobs is not None for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in entries] == [(c.token, round(c.logprob, 4)) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=48,
                                           temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text
    # characters split across tokens: each token's own bytes, which join into the text (decoding one
    # such token alone gives U+FFFD); logprobs: 1 is the flag, as in vLLM
    emoji, r = ask(client, "Reply with only these emoji: \U0001F34E\U0001F34C\U0001F347", logprobs=1)
    content = r.choices[0].logprobs.content
    assert any(len(c.bytes) < len(c.token.encode()) or "\\x" in c.token for c in content)  # split characters
    assert b"".join(bytes(c.bytes) for c in content).decode().replace("<|im_end|>", "") == emoji
    assert len({c.token for c in content if "\\x" in c.token}) > 1  # distinct texts for distinct byte tokens
    # completions: the legacy object, cut at a stop sequence
    prompt = "The colours of the rainbow are"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=2)
    lp = full.choices[0].logprobs
    assert "".join(lp.tokens) == full.choices[0].text and len(lp.tokens) == full.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    ref = reference(tok.encode(prompt), tok.encode(prompt + full.choices[0].text)[len(tok.encode(prompt)):])
    assert all(len(d) in (2, 3) and lp.tokens[j] in d for j, d in enumerate(lp.top_logprobs))
    assert abs(lp.token_logprobs[0] - ref[0].max()) < 2e-3
    stop = lp.tokens[3].strip() or lp.tokens[4].strip()
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0, stop=[stop])
    clp = cut.choices[0].logprobs
    assert cut.choices[0].finish_reason == "stop" and len(clp.tokens) == cut.usage.completion_tokens
    assert clp.token_logprobs == lp.token_logprobs[:len(clp.tokens)] and all(len(d) == 1 for d in clp.top_logprobs)
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                              temperature=0, logprobs=0, stop=[stop], stream=True)]
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == clp.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == clp.text_offset


def test_n_choices_are_the_answers_of_their_seeds_streamed_or_not(client):
    """n > 1: greedy choices are all the greedy answer; sampled choice i is the answer of a request
    with seed + i alone; usage counts the prompt once and every choice's tokens; a stream's chunks,
    gathered by index, give the same choices, each with its finish_reason; logprobs come per choice."""
    msgs = [{"role": "user", "content": QUESTIONS[6]}]
    one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    many = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 3
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    kw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=1.0, top_p=0.95)
    alone = [client.chat.completions.create(seed=40 + i, **kw).choices[0].message.content for i in range(3)]
    assert len(set(alone)) > 1  # the seeds sample different answers
    sampled = client.chat.completions.create(seed=40, n=3, logprobs=True, **kw)
    assert [c.message.content for c in sampled.choices] == alone
    assert all(c.logprobs is not None and len(c.logprobs.content) > 0 for c in sampled.choices)
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in client.chat.completions.create(seed=40, n=3, stream=True, stream_options={"include_usage": True},
                                                **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == sampled.usage.completion_tokens
    assert texts == alone and all(r in ("stop", "length") for r in reasons)
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.8,
                                     seed=7, n=2, stop=["."])
    solo = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.8,
                                      seed=7 + i, stop=["."]).choices[0] for i in range(2)]
    assert [(c.text, c.finish_reason) for c in comp.choices] == [(c.text, c.finish_reason) for c in solo]


def test_logit_bias_bans_and_forces_tokens_as_plain_decoding_does(client, smollm2):
    """logit_bias with the openai client: banning the greedy answer's first token gives the answer
    plain greedy decoding with that bias gives (the engine's plain steps, speculation off); +100 on a
    token makes it every token."""
    import medusa_jax as mj
    from medusa_jax.engine.engine import Engine
    from medusa_jax.decoding.requests import Request as EngineRequest

    q = QUESTIONS[4]
    msgs = [{"role": "user", "content": q}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True)
    banned = smollm2.tokenizer.encode(first.choices[0].logprobs.content[0].token, add_special_tokens=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                       logit_bias={str(banned): -100})
    ids = mj.apply_chat_template(smollm2.tokenizer, q)
    engine = Engine(smollm2.cfg, smollm2.params, max_batch=1, speculation="off")
    handle = engine.submit(EngineRequest(ids, 16, logit_bias={banned: -100.0}))
    engine.run()
    want = smollm2.tokenizer.decode(handle.finished.tokens, skip_special_tokens=True)
    assert r.choices[0].message.content == want != first.choices[0].message.content
    assert banned not in handle.finished.tokens
    forced = smollm2.tokenizer.encode(" yes", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="Say no.", max_tokens=5, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == smollm2.tokenizer.decode([forced] * 5)


def test_penalties_are_plain_decodings_with_the_same_penalties(client, smollm2):
    """presence_penalty, frequency_penalty (OpenAI's), repetition_penalty and min_p (vLLM's, through
    the openai client's extra_body) with the openai client: the server's Medusa answer is the engine's
    plain decoding with the same settings, greedy and sampled, and the penalties change the answer."""
    import medusa_jax as mj
    from medusa_jax.engine.engine import Engine
    from medusa_jax.decoding.requests import Request as EngineRequest
    from medusa_jax.decoding.requests import SamplingParams

    q = QUESTIONS[1]
    msgs = [{"role": "user", "content": q}]
    ids = mj.apply_chat_template(smollm2.tokenizer, q)
    engine = Engine(smollm2.cfg, smollm2.params, max_batch=1, speculation="off")
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0)
    answers = []
    for kw, sampling in (
            (dict(frequency_penalty=1.0, presence_penalty=0.5), SamplingParams(presence_penalty=0.5,
                                                                              frequency_penalty=1.0)),
            (dict(temperature=0.8, seed=3, extra_body={"repetition_penalty": 1.3, "min_p": 0.05}),
             SamplingParams(0.8, 1.0, 3, min_p=0.05, repetition_penalty=1.3))):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, **dict({"temperature": 0}, **kw))
        handle = engine.submit(EngineRequest(ids, 48, sampling))
        engine.run()
        want = smollm2.tokenizer.decode(handle.finished.tokens, skip_special_tokens=True)
        assert r.choices[0].message.content == want, kw
        answers.append(want)
    assert answers[0] != first.choices[0].message.content  # the greedy penalties changed the answer


def test_bad_words_and_allowed_token_ids_are_plain_decodings_with_the_same_bans(client, server, smollm2):
    """vLLM's bad_words and allowed_token_ids through the openai client's extra_body: the words are
    tokenized as vLLM does (at the start and after a space), the server's Medusa answer is the
    engine's plain decoding with the same bans, it holds none of the words, and a bad word of the
    free answer changes it."""
    import medusa_jax as mj
    from medusa_jax.engine.engine import Engine
    from medusa_jax.decoding.requests import Request as EngineRequest
    from medusa_jax.serve.text import bad_words_ids

    tok = smollm2.tokenizer
    q = "Name three primary colours."
    msgs = [{"role": "user", "content": q}]
    ids = mj.apply_chat_template(tok, q)
    free = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    words = [w.strip(",.") for w in free.choices[0].message.content.split()[2:6]]
    assert bad_words_ids(tok, ["Paris"]) == [tok.encode("Paris", add_special_tokens=False)] + (
        [tok.encode(" Paris", add_special_tokens=False)] if len(tok.encode(" Paris", add_special_tokens=False)) ==
        len(tok.encode("Paris", add_special_tokens=False)) else [])
    engine = Engine(smollm2.cfg, smollm2.params, max_batch=1, speculation="off")
    allowed = sorted(set(ids) | set(tok.encode(" red blue yellow green and the colours are Red Blue Yellow.\n",
                                              add_special_tokens=False)) | set(engine.eos))
    for extra in ({"bad_words": words}, {"allowed_token_ids": allowed}):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, extra_body=extra)
        handle = engine.submit(EngineRequest(ids, 40, allowed_token_ids=extra.get("allowed_token_ids"),
                                             bad_words=bad_words_ids(tok, extra.get("bad_words", []))))
        engine.run()
        want = tok.decode(handle.finished.tokens, skip_special_tokens=True)
        assert r.choices[0].message.content == want, extra
        assert want != free.choices[0].message.content, extra
        if "bad_words" in extra:
            out = list(handle.finished.tokens)
            assert not any(out[k:k + len(w)] == w for w in bad_words_ids(tok, words) for k in range(len(out)))
        else:
            assert set(handle.finished.tokens) <= set(allowed)
    for extra, message in (({"allowed_token_ids": []}, "allowed_token_ids is empty"),
                           ({"bad_words": ["ok", ""]}, "bad_words must be a list of non-empty strings"),
                           ({"bad_words": ["word " * 40]}, "bad_words: a word of")):
        r = httpx.post(server[0] + "/v1/chat/completions", json=dict(model=MODEL, messages=msgs, **extra))
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_min_tokens_holds_off_eos_and_stop_strings(client, smollm2):
    """min_tokens (vLLM's, the openai client's extra_body): a short answer goes on past its EOS to
    min_tokens tokens, as the engine's plain steps with min_tokens decode it, and a stop string
    within them does not end it."""
    import medusa_jax as mj
    from medusa_jax.engine.engine import Engine
    from medusa_jax.decoding.requests import Request as EngineRequest

    q = QUESTIONS[5]
    msgs = [{"role": "user", "content": q}]
    free = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 40
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0,
                                       extra_body={"min_tokens": 48})
    assert r.usage.completion_tokens >= 48
    engine = Engine(smollm2.cfg, smollm2.params, max_batch=1, speculation="off")
    handle = engine.submit(EngineRequest(mj.apply_chat_template(smollm2.tokenizer, q), 64, min_tokens=48))
    engine.run()
    assert r.choices[0].message.content == smollm2.tokenizer.decode(handle.finished.tokens, skip_special_tokens=True)
    assert r.choices[0].message.content.startswith(free.choices[0].message.content)
    stop = free.choices[0].message.content.split()[1]  # a word of the answer's first tokens
    cut = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0, stop=[stop],
                                         extra_body={"min_tokens": 48})
    assert len(cut.choices[0].message.content) > len(free.choices[0].message.content.split(stop)[0])


def test_openai_defaults_and_vllm_extensions_are_checked():
    """Fields sent at their defaults pass (clients send them); vLLM's extensions are honoured or
    refused, never ignored; any 64-bit seed maps into the engine's; integral floats are integers;
    where max_completion_tokens wins, max_tokens need only be an integer."""
    from medusa_jax.serve.protocol import RequestError, check_request

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    defaults = {"best_of": 1, "suffix": "", "modalities": ["text"], "tool_choice": "none", "echo": False,
                "min_tokens": 0, "repetition_penalty": 1, "min_p": 0.0, "skip_special_tokens": True, "tools": [],
                "top_k": -1, "logprobs": False}
    gen = check_request(dict(body, **defaults), [MODEL], 64, True)
    assert (gen.temperature, gen.stop_token_ids, gen.ignore_eos, gen.include_stop) == (1.0, None, False, False)
    assert gen.eos_override([2]) is None and gen.add_generation_prompt and not gen.continue_final_message
    for name, value in (("skip_special_tokens", False), ("best_of", 2), ("suffix", "x"), ("tool_choice", "required"),
                        ("use_beam_search", True)):
        with pytest.raises(RequestError, match=f"^{name}") as e:
            check_request(dict(body, **{name: value}), [MODEL], 64, True)
        assert e.value.param == name and e.value.code == "unsupported_parameter"
    gen = check_request(dict(body, presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.2, min_p=0.1),
                        [MODEL], 64, True)
    assert (gen.presence_penalty, gen.frequency_penalty, gen.repetition_penalty, gen.min_p) == (-2.0, 1.5, 1.2, 0.1)
    gen = check_request(body, [MODEL], 64, True)
    assert (gen.presence_penalty, gen.frequency_penalty, gen.repetition_penalty, gen.min_p) == (0.0, 0.0, 1.0, 0.0)
    for name, bad, interval in (("presence_penalty", 2.5, r"\[-2.0, 2.0\]"), ("frequency_penalty", -3, r"\[-2.0, 2.0\]"),
                                ("repetition_penalty", 0, r"\[0.01, 2.0\]"), ("min_p", 1.01, r"\[0.0, 1.0\]"),
                                ("presence_penalty", 10 ** 400, r"\[-2.0, 2.0\], got an integer of 401 digits"),
                                ("temperature", -10 ** 400, r"\[0.0, 2.0\], got an integer of 401 digits"),
                                ("min_p", True, "")):
        with pytest.raises(RequestError, match=f"^{name} must be {'in ' + interval if interval else 'a number'}") as e:
            check_request(dict(body, **{name: bad}), [MODEL], 64, True)
        assert e.value.param == name
    assert check_request(dict(body, top_k=1, temperature=0.9), [MODEL], 64, True).temperature == 0.0  # greedy
    for k, want in ((-1, 0), (0, 0), (5, 5), (10 ** 12, 10)):  # k >= the vocabulary: every token
        assert check_request(dict(body, top_k=k), [MODEL], 64, True, vocab_size=10).top_k == want, k
    assert check_request(dict(body, seed=7), [MODEL], 64, True).seed == 7
    assert check_request(dict(body, seed=2 ** 40 + 7), [MODEL], 64, True).seed == 7
    assert check_request(dict(body, seed=-1), [MODEL], 64, True).seed == 2 ** 31 - 1
    # JSON has one number type: integral floats are integers (as vLLM's pydantic models take them)
    gen = check_request(dict(body, seed=7.0, top_k=5.0, max_tokens=16.0, n=1.0, stop_token_ids=[5.0]),
                        [MODEL], 64, True, vocab_size=10)
    assert (gen.seed, gen.top_k, gen.max_tokens, gen.stop_token_ids) == (7, 5, 16, [5])
    assert all(type(v) is int for v in (gen.seed, gen.top_k, gen.max_tokens, *gen.stop_token_ids))
    for name, bad in (("seed", 7.5), ("max_tokens", 16.25), ("top_k", float("inf")), ("n", float("nan"))):
        with pytest.raises(RequestError, match=f"^{name} must be an integer") as e:
            check_request(dict(body, **{name: bad}), [MODEL], 64, True)
        assert e.value.param == name
    gen = check_request(dict(body, ignore_eos=True, stop_token_ids=[5, 9], include_stop_str_in_output=True),
                        [MODEL], 64, True, vocab_size=10)
    assert gen.eos_override([2]) == [5, 9] and gen.include_stop
    assert check_request(dict(body, stop_token_ids=[5]), [MODEL], 64, True, 10).eos_override([2]) == [2, 5]
    assert check_request(dict(body, ignore_eos=True), [MODEL], 64, True).eos_override([2]) == []
    for bad in ([10], [-1], ["5"], 5, [True], [5.5]):
        with pytest.raises(RequestError, match="stop_token_ids must be a list of token ids in \\[0, 10\\)"):
            check_request(dict(body, stop_token_ids=bad), [MODEL], 64, True, 10)
    for extra, param in (({"max_completion_tokens": 3, "max_tokens": "lots"}, "max_tokens"),
                         ({"max_completion_tokens": 3, "max_tokens": 2.5}, "max_tokens"),
                         ({"logit_bias": {"5": 101}}, "logit_bias"), ({"documents": [{"text": "x"}]}, "documents"),
                         ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
                          "stream_options.continuous_usage_stats"),
                         ({"stream": True, "stream_options": []}, "stream_options"),
                         ({"stream": True, "stream_options": False}, "stream_options"),
                         ({"top_logprobs": 3}, "top_logprobs"), ({"ignore_eos": "yes"}, "ignore_eos")):  # (no flag)
        with pytest.raises(RequestError) as e:
            check_request(dict(body, **extra), [MODEL], 64, True)
        assert e.value.param == param, (extra, e.value.param)
    assert check_request(dict(body, max_completion_tokens=3, max_tokens=9), [MODEL], 64, True).max_tokens == 3
    # max_completion_tokens wins, so max_tokens need only be an integer (vLLM's rule)
    assert check_request(dict(body, max_completion_tokens=3, max_tokens=10 ** 7), [MODEL], 64, True).max_tokens == 3
    assert check_request(dict(body, max_completion_tokens=3, max_tokens=-6), [MODEL], 64, True).max_tokens == 3
    # logprobs: a chat's flag (false, 0: none) with top_logprobs alternatives; a completion's count of
    # alternatives (0: the chosen token's own log-probability; null: none)
    for extra, want in (({"logprobs": False}, None), ({"logprobs": 0}, None), ({"logprobs": True}, 0),
                        ({"logprobs": True, "top_logprobs": 5}, 5), ({"logprobs": True, "top_logprobs": 20.0}, 20)):
        assert check_request(dict(body, **extra), [MODEL], 64, True).logprobs == want, extra
    for value, want in ((None, None), (0, 0), (1, 1), (20, 20)):
        assert check_request({"prompt": "x", "logprobs": value}, [MODEL], 64, False).logprobs == want
    for extra, chat, message in (({"logprobs": "yes"}, True, "logprobs must be a boolean"),
                                 ({"logprobs": True, "top_logprobs": 21}, True, r"top_logprobs must be in \[0, 20\]"),
                                 ({"logprobs": False, "top_logprobs": 2}, True, "top_logprobs needs logprobs: true"),
                                 ({"logprobs": 21}, False, r"logprobs must be in \[0, 20\], got 21"),
                                 ({"logprobs": True}, False, "logprobs must be an integer"),
                                 ({"top_logprobs": 2}, False, "top_logprobs is a chat field")):
        b = dict(body, **extra) if chat else {"prompt": "x", **extra}
        with pytest.raises(RequestError, match=message):
            check_request(b, [MODEL], 64, chat)
    assert check_request(dict(body, logit_bias={"5": 0, "9": 0.0}), [MODEL], 64, True).logit_bias is None  # nothing
    assert check_request(dict(body, logit_bias={"5": -100, "9": 2.5}), [MODEL], 64, True).logit_bias == {5: -100.0,
                                                                                                          9: 2.5}
    for bias, message in (({"x": 1}, "'x' is not a token id in"), ({"10": 1}, r"'10' is not a token id in \[0, 10\)"),
                          ({"-1": 1}, "is not a token id"), ({"5": "1"}, r"number in \[-100, 100\], got '1'"),
                          ({"5": True}, "got True"), ([5], "must be an object"),
                          ({"\u0665": 1}, "is not a token id"), ({"\uff15": 1}, "is not a token id"),  # not ASCII
                          ({"5": 1, "05": 2}, r"token 5 is given twice \(as '05' too\)"),
                          ({str(i): 1 for i in range(301)}, "at most 300 tokens, got 301")):
        with pytest.raises(RequestError, match=message) as e:
            check_request(dict(body, logit_bias=bias), [MODEL], 64, True, vocab_size=10)
        assert e.value.param == "logit_bias"
    for extra, param in (({"guided_json": {}}, "guided_json"),  # vLLM: any JSON, not free text
                         ({"seed": 2 ** 63}, "seed"), ({"top_k": -2}, "top_k"),
                         ({"add_special_tokens": True}, "add_special_tokens"),
                         ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
                         ({"chat_template": "{{ messages }}"}, "chat_template")):
        with pytest.raises(RequestError) as e:
            check_request(dict(body, **extra), [MODEL], 64, True)
        assert e.value.param == param, (extra, e.value)
    assert check_request(dict(body, chat_template_kwargs={"enable_thinking": False}), [MODEL], 64,
                         True).template_kwargs == {"enable_thinking": False}
    assert check_request({"prompt": "x", "add_special_tokens": True}, [MODEL], 64, False).prompts == ["x"]
    prefill = {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure"}]}
    with pytest.raises(RequestError, match="needs add_generation_prompt false"):
        check_request(dict(prefill, continue_final_message=True), [MODEL], 64, True)
    gen = check_request(dict(prefill, continue_final_message=True, add_generation_prompt=False), [MODEL], 64, True)
    assert gen.continue_final_message and not gen.add_generation_prompt


def test_vllm_extensions_chats_not_ending_with_the_user_and_cors(client, server, smollm2):
    """ignore_eos runs to max_tokens past the answer's end; stop_token_ids end it at a token;
    include_stop_str_in_output keeps the stop; top_k 1 is greedy; a chat ending with the assistant's
    message gets a new answer, and with continue_final_message its text goes on; a system-only chat
    is answered; a browser's CORS preflight is allowed; chunks carry usage null when usage is asked."""
    url = server[0]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    base = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0)
    text, n = base.choices[0].message.content, base.usage.completion_tokens
    assert base.choices[0].finish_reason == "stop" and n < 60, (text, n)
    assert base.system_fingerprint is None and "system_fingerprint" in base.model_dump(exclude_unset=True)
    long = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n + 8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == n + 8 and long.choices[0].finish_reason == "length"
    assert long.choices[0].message.content.startswith(text)
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)  # the answer's tokens (re-encoded)
    cut = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0,
                                         extra_body={"stop_token_ids": [ids[2]]})
    j = ids.index(ids[2])
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == j + 1
    assert cut.choices[0].message.content == smollm2.tokenizer.decode(ids[:j])  # vLLM: without the stop's text
    kept = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0,
                                          extra_body={"stop_token_ids": [ids[2]], "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == smollm2.tokenizer.decode(ids[:j + 1])
    greedy_k = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=1.0,
                                              extra_body={"top_k": 1})
    assert greedy_k.choices[0].message.content == text
    word = text.split()[1]
    kept = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0, stop=[word],
                                          extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[:text.index(word) + len(word)]
    follow = msgs + [{"role": "assistant", "content": text}]
    again = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=16, temperature=0)
    assert again.choices[0].message.content and again.usage.prompt_tokens > base.usage.prompt_tokens
    head = " ".join(text.split(" ")[:3])  # cut before a word's space, where the answer's own tokens split it
    cont = client.chat.completions.create(
        model=MODEL, messages=msgs + [{"role": "assistant", "content": head}], max_tokens=64, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert head + cont.choices[0].message.content == text, (head, cont.choices[0].message.content, text)
    alone = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Say hello."}],
                                           max_tokens=8, temperature=0)
    assert alone.choices[0].message.content
    pre = httpx.options(url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")
    body = {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in c for c in chunks) and [c["usage"] is None for c in chunks] == \
        [True] * (len(chunks) - 1) + [False]


def test_allowed_origins_take_vllms_json_list_too():
    from medusa_jax.cli.serve import parse_origins

    assert parse_origins("*") == ["*"] and parse_origins("") == []
    assert parse_origins("http://localhost:3000/, https://app.example") == ["http://localhost:3000",
                                                                            "https://app.example"]
    assert parse_origins('["http://localhost:3000"]') == ["http://localhost:3000"]
    with pytest.raises(ValueError, match="a JSON list must hold origin strings"):
        parse_origins("[1]")


def test_token_pieces_give_each_tokens_own_bytes_for_sentencepiece_vocabularies_too():
    """`TokenPieces` on a SentencePiece-style vocabulary (Llama 2's, Mistral's: ▁ for a space, byte
    tokens <0xNN> for characters outside it): a byte token is its byte, ▁ a space, so the bytes of an
    emoji's byte tokens join into the emoji; `TextOffsets` counts the emoji from its first byte."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from medusa_jax.serve.text import TextOffsets, TokenPieces

    vocab = {"<unk>": 0, "</s>": 1, "\u2581hello": 2, "\u2581world": 3}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    pieces = TokenPieces(tok)
    apple = "\U0001F34E".encode()
    ids = [2] + [4 + b for b in apple] + [3, 1]
    assert pieces.byte_level is None
    assert [pieces.bytes(t) for t in ids] == [b" hello"] + [bytes([b]) for b in apple] + [b" world", b"</s>"]
    assert pieces.text(4 + apple[0]) == "\\xf0" and pieces.text(2) == " hello"
    offsets = TextOffsets(pieces)
    assert [offsets.next(t) for t in ids] == [0, 6, 6, 6, 6, 7, 13]
    offsets = TextOffsets(pieces)  # a lone lead byte that the next token does not continue: one U+FFFD
    lone = [2, 4 + apple[0], 3]
    assert [offsets.next(t) for t in lone] == [0, 6, 7]
    assert tok.decode(lone) == "hello\ufffd world"  # (SentencePiece's decoder strips the first space)
    # an answer's text is what its tokens add to the prompt's: " world" after "hello", not "world"
    from medusa_jax.serve.text import TextStream
    assert TextStream(tok, []).feed([3, 2], final=True) == ("world hello", False)
    after = TextStream(tok, [], after=[2])
    assert after.feed([3]) == (" world", False) and after.feed([2, 1], final=True) == (" hello", False)
    assert TextStream(tok, ["d h"], after=[2]).feed([3, 2]) == (" worl", True)
    assert TextStream(tok, [], after=[2, 4 + apple[0]]).feed([3], final=True) == (" world", False)  # after U+FFFD
    # a prompt that ends inside a character the answer finishes: the answer's text alone, as before
    rest = [4 + b for b in apple[1:]] + [3]
    assert TextStream(tok, [], after=[2, 4 + apple[0]]).feed(rest, final=True) == TextStream(tok, []).feed(rest, True)

