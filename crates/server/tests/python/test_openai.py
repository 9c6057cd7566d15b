"""`ballast serve` driven by the real `openai` package (pinned in requirements.txt).

Starts the server on the default model (BALLAST_BIN names the binary), then checks
what a client of the OpenAI API relies on: the model list, chat and text completions,
streaming with usage, log-probabilities, stop strings, and the errors the client turns
into exceptions. Generations are a few tokens long. Run by `cargo xtask test`.
"""

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai


def start(*flags):
    """A server on a free port; returns the process and its base URL once ready."""
    binary = os.environ.get("BALLAST_BIN", "target/debug/ballast")
    proc = subprocess.Popen(
        [binary, "serve", "--port", "0", "-t", "2", *flags],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    base = None
    for line in proc.stderr:
        if line.startswith("listening on "):
            base = line.split()[-1]
            break
    assert base, "ballast serve exited before listening"
    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(base + "/health") as r:
                if r.status == 200:
                    break
        except urllib.error.HTTPError as e:
            assert e.code == 503, e
        except urllib.error.URLError:
            pass
        assert time.time() < deadline, "the server never became ready"
        time.sleep(0.05)
    return proc, base


def check_chat(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion", r
    assert r.id.startswith("chatcmpl-"), r
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content, r
    assert c.finish_reason == "length", r
    assert r.usage.completion_tokens == 5, r.usage
    assert r.usage.prompt_tokens + 5 == r.usage.total_tokens, r.usage
    return c.message.content


def check_chat_stream(client, model, expected):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1, "one id per stream"
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choice = [c for c in chunks if c.choices]
    assert with_choice[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choice[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in with_choice)
    assert text == expected, (text, expected)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def check_completion(client, model):
    r = client.completions.create(
        model=model,
        prompt="Once upon a time, there was a little",
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion", r
    c = r.choices[0]
    assert len(c.logprobs.tokens) == 8 and "".join(c.logprobs.tokens) == c.text, c
    # A stop string from the middle of that text ends it there, without the stop.
    stop = c.text[3:7]
    s = client.completions.create(
        model=model,
        prompt="Once upon a time, there was a little",
        max_tokens=8,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert s.choices[0].text == c.text[: c.text.index(stop)], (s, stop)
    assert s.choices[0].finish_reason == "stop"


def check_logprobs(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 2, content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token


def check_errors(client, model):
    messages = [{"role": "user", "content": "Hi"}]
    for kwargs in (
        {"top_p": 2},
        {"temperature": -1},
        {"n": 2},
        {"model": "no-such-model"},
    ):
        args = {"model": model, "messages": messages, "max_tokens": 1, **kwargs}
        try:
            client.chat.completions.create(**args)
        except openai.BadRequestError as e:
            assert e.status_code == 400
            assert e.body and e.body.get("message"), e.body
        else:
            raise AssertionError(f"{kwargs} was accepted")


def main():
    proc, base = start("--parallel", "2")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        text = check_chat(client, model)
        check_chat_stream(client, model, text)
        check_completion(client, model)
        check_logprobs(client, model)
        check_errors(client, model)
        with urllib.request.urlopen(base + "/metrics") as r:
            metrics = r.read().decode()
        assert "ballast_requests_waiting" in metrics and "ballast_kv_cache_usage_ratio" in metrics
    finally:
        proc.kill()
        proc.wait()

    proc, base = start("--parallel", "1", "--api-key", "sekret")
    try:
        wrong = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        try:
            wrong.models.list()
        except openai.AuthenticationError as e:
            assert e.status_code == 401
        else:
            raise AssertionError("a wrong key was accepted")
        right = openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
        assert right.models.list().data
    finally:
        proc.kill()
        proc.wait()
    print("openai end-to-end: ok")


if __name__ == "__main__":
    sys.exit(main())
