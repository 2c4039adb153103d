"""The official `openai` client against a real server: completions and chat, whole and streamed; greedy output
through the API equals `LLM.generate`; the SSE framing read raw."""

import json

import httpx
import openai
import pytest

from rimuru import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The quick brown fox", "Memory is a pool of pages"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_path):
    """`LLM.generate`'s greedy outputs for PROMPTS and for the chat prompt, EOS ignored so lengths are fixed."""
    llm = LLM(tiny_model_path, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chat_ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids
    outputs = llm.generate(PROMPTS + [list(chat_ids)], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen-moe"]


def test_completion_greedy_equals_llm_generate(client, offline):
    for prompt, expected in zip(PROMPTS, offline):
        response = client.completions.create(model="tiny-qwen-moe", prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        choice = response.choices[0]
        assert choice.text == expected.text and choice.finish_reason == "length"
        assert response.usage.completion_tokens == MAX_TOKENS and response.usage.prompt_tokens > 0


def test_completion_stream_equals_llm_generate(client, offline):
    stream = client.completions.create(model="tiny-qwen-moe", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline[0].text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompt_and_logprobs(client, offline, tiny_model_path):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model_path).encode(PROMPTS[1])
    response = client.completions.create(model="tiny-qwen-moe", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    choice = response.choices[0]
    assert choice.text == offline[1].text
    assert len(choice.logprobs.tokens) == MAX_TOKENS and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)  # greedy: the sampled token is the top one
    assert all(max(top.values()) == pytest.approx(lp) for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))


def test_chat_greedy_equals_llm_generate(client, offline):
    response = client.chat.completions.create(model="tiny-qwen-moe", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert response.choices[0].message.content == offline[-1].text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens == MAX_TOKENS


def test_chat_stream_n_and_logprobs(client):
    stream = client.chat.completions.create(model="tiny-qwen-moe", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, n=2, seed=7, stream=True, logprobs=True, top_logprobs=1,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    content, roles, finish = {0: "", 1: ""}, set(), {}
    num_logprobs = {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            roles.add(choice.delta.role) if choice.delta.role else None
            content[choice.index] += choice.delta.content or ""
            num_logprobs[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == 12
    assert roles == {"assistant"} and finish == {0: "length", 1: "length"} and num_logprobs == {0: 6, 1: 6}


def test_seed_reproducible_and_stop_string(client):
    kwargs = {"model": "tiny-qwen-moe", "prompt": "Once upon", "max_tokens": 10, "temperature": 1.0, "seed": 123}
    first, second = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    assert first == second
    greedy = client.completions.create(model="tiny-qwen-moe", prompt="Once upon", max_tokens=10, temperature=0).choices[0]
    if len(greedy.text) > 3:
        stop = greedy.text[2:4]
        stopped = client.completions.create(model="tiny-qwen-moe", prompt="Once upon", max_tokens=10, temperature=0,
                                            stop=[stop]).choices[0]  # fmt: skip
        assert stopped.finish_reason == "stop" and stop not in stopped.text and greedy.text.startswith(stopped.text)


def test_raw_sse_framing(server):
    body = {"prompt": "Hello", "max_tokens": 5, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["usage"] == {"prompt_tokens": payloads[-1]["usage"]["prompt_tokens"], "completion_tokens": 5,
                                     "total_tokens": payloads[-1]["usage"]["prompt_tokens"] + 5}  # fmt: skip
    assert sum(1 for p in payloads if p["choices"] and p["choices"][0]["finish_reason"] == "length") == 1


def test_return_token_ids_streams_every_step_with_the_tokens(server, offline):
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert all(c["token_ids"] for c in choices)  # a chunk a step, each with its new tokens
    assert [t for c in choices for t in c["token_ids"]] == offline[0].token_ids
    whole = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": False}, timeout=30).json()
    assert whole["choices"][0]["token_ids"] == offline[0].token_ids


def test_rejected_stream_is_never_a_200(server):
    body = {"prompt": [5] * 200, "max_tokens": 5, "stream": True}  # longer than --max-model-len 128
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    message = response.json()["error"]["message"]
    assert "200" in message and "128" in message


def test_tiny_temperature_is_greedy(client):
    """logits / 1e-300 overflows; the server treats temperatures below 1e-5 as greedy, as vLLM does."""
    texts = [client.completions.create(model="tiny-qwen-moe", prompt="Hello", max_tokens=4, temperature=t).choices[0].text
             for t in (0.0, 1e-300)]  # fmt: skip
    assert texts[0] == texts[1]


def test_streamed_text_never_takes_back_a_stop_string(client):
    """Text that could still become the stop string is held back, so the streamed text equals the whole answer."""
    greedy = client.completions.create(model="tiny-qwen-moe", prompt="The quick", max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    kwargs = {"model": "tiny-qwen-moe", "prompt": "The quick", "max_tokens": 12, "temperature": 0, "stop": [stop]}
    whole = client.completions.create(**kwargs).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert whole.finish_reason == "stop" and streamed == whole.text and stop not in streamed


@pytest.mark.parametrize("extra, refused", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "text"}, "tool_choice": "none"}, None),
])  # fmt: skip
def test_tools_and_json_mode_are_refused_not_ignored(server, extra, refused):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | extra
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    if refused is None:
        assert response.status_code == 200
    else:
        assert response.status_code == 400 and refused in response.json()["error"]["message"]


def test_chat_logprob_bytes_are_the_tokens_own_and_join_into_the_text(client):
    """Sampled at temperature 1, the tiny tokenizer's byte tokens split characters; their `bytes` still join into the
    text's UTF-8 (they were U+FFFD's three bytes each)."""
    from transformers import AutoTokenizer

    from rimuru.models.checkpoint import tiny_model_path
    from rimuru.serving.choice import token_bytes

    reply = client.chat.completions.create(model="tiny-qwen-moe", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=24, temperature=1.0, seed=3, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    choice = reply.choices[0]
    joined = b"".join(bytes(entry.bytes) for entry in choice.logprobs.content)
    assert joined.decode("utf-8", errors="replace") == choice.message.content
    assert any(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for e in choice.logprobs.content)  # a split character
    assert all(len(e.top_logprobs) == 2 and all(t.bytes for t in e.top_logprobs) for e in choice.logprobs.content)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    assert b"".join(token_bytes(tokenizer, i) for i in tokenizer.encode("日本")) == "日本".encode()


def test_an_event_never_holds_a_raw_unicode_line_break():
    """JSON may carry U+0085, U+2028 and U+2029 raw; a client splitting lines as str.splitlines does would cut the
    event there, so the data line escapes them and still decodes to the same text."""
    from rimuru.serving.openai_api import sse_json

    text = "a\u0085b\u2028c\u2029d é\n"
    data = sse_json({"choices": [{"text": text}]}).decode()
    assert len(data.splitlines()) == 1 and json.loads(data)["choices"][0]["text"] == text
