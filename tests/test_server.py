"""The OpenAI-compatible server, end to end: a real `kvhandoff serve` process, the official `openai`
client for the happy paths and raw httpx where the wire format itself is under test (SSE framing,
`timings`, error bodies, disconnects)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import ServerProcess

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "How does a server hand over the cache?"}]
TIMING_KEYS = {"queue_ms", "prefill_ms", "ttft_ms", "decode_ms"}
LONG = 4000            # tokens: a generation that runs for many seconds on the tiny model


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(tiny_server) -> str:
    return tiny_server.served_name


def post(server, path: str, body=None, *, content: bytes | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, content=content, timeout=timeout)


def sse_chunks(response: httpx.Response) -> list:
    """Every `data:` payload of an SSE stream, decoded; the [DONE] sentinel is kept as a string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def stream(server, path: str, body: dict) -> list:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return sse_chunks(r)


def metric(server, name: str, **labels) -> float:
    """One sample of /metrics (0 if absent)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m and m[1] == name and ",".join(sorted((m[2] or "").split(","))).strip(",") == want:
            return float(m[3])
    return 0.0


def wait_idle(server, timeout: float = 20) -> dict:
    """Poll /health until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if h["num_running"] == 0 and h["num_waiting"] == 0 and h["num_free_blocks"] == server.baseline["num_free_blocks"]:
            return h
        if time.monotonic() > deadline:
            pytest.fail(f"pool not back to baseline after {timeout}s: {h} vs {server.baseline}")
        time.sleep(0.05)


def check_timings(timings: dict) -> None:
    assert TIMING_KEYS <= timings.keys(), timings
    for key in TIMING_KEYS:
        assert isinstance(timings[key], (int, float)) and timings[key] >= 0, (key, timings)
    assert timings["ttft_ms"] >= timings["prefill_ms"]


# ---------------------------------------------------------------------------------------------------
# Happy paths through the official client

def test_models_and_health(client, tiny_server, model):
    assert [m.id for m in client.models.list().data] == [model] == ["tiny"]
    h = tiny_server.health()
    assert h["status"] == "ok" and h["num_blocks"] == 512 and h["num_free_blocks"] == 512
    # What the worker computes with, as chosen for this machine (issue 12).
    assert h["device"] == "cpu" and h["dtype"] in ("float32", "bfloat16") and h["kernels"].startswith(("on", "off"))
    # Prompts row by row like decode rows (issue 25) is what makes a token's logits batch-invariant.
    assert h["batch_invariant"] == ("prompts row by row" in h["kernels"]), h
    # --dtype auto, and why it chose; the threads the engine computes with (ServerProcess asks for one)
    assert h["dtype_reason"].startswith("auto: ") and h["threads"] == 1, h


def test_completion(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == model and r.id.startswith("cmpl-")
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    # The same prompt again is deterministic under greedy decoding (and hits the prefix cache).
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text \
        == r.choices[0].text


def test_token_id_prompts(client, model):
    ids = [40, 41, 42, 43, 44, 45, 46]
    a = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    b = client.completions.create(model=model, prompt=[ids], max_tokens=8, temperature=0)   # a batch of one
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens == 8
    assert a.choices[0].text == b.choices[0].text != ""


def test_chat(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    # max_completion_tokens is the newer spelling of max_tokens.
    r2 = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert r2.choices[0].message.content == msg.content


def test_streaming_equals_non_streaming(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_usage_chunk(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_sampling_fields_reach_the_engine(client, model):
    # stop: output is cut just before the first occurrence of the stop string.
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    # (ASCII letters: a stop string inside a multi-byte character would be matched mid-decode)
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 1) if text[i:i + 2].isascii()
                and text[i:i + 2].isalpha())
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.find(stop)]
    # seed: the same seed gives the same sample at temperature 1.
    a, b = (client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7)
            .choices[0].text for _ in range(2))
    assert a == b
    # extensions and ignored OpenAI defaults pass through the SDK's extra_body.
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, frequency_penalty=0,
                                  extra_body={"top_k": 5, "min_tokens": 4, "ignore_eos": True, "logit_bias": {},
                                              "some_future_field": 1})
    assert r.usage.completion_tokens == 4


def test_concurrent_streams_agree(client, model):
    """Four streams at once (batched in the engine, bridged to one event loop) give the greedy text."""
    want = client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0)

    def one(_):
        chunks = client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == [want.choices[0].message.content] * 4


# ---------------------------------------------------------------------------------------------------
# Wire format: timings on every response and on the last streamed chunk

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0}),
])
def test_timings(tiny_server, path, body):
    r = post(tiny_server, path, body)
    assert r.status_code == 200
    check_timings(r.json()["timings"])

    chunks = stream(tiny_server, path, body)
    assert chunks[-1] == "[DONE]"
    last = chunks[-2]
    assert last["choices"][0]["finish_reason"] == "length"
    check_timings(last["timings"])
    assert all("timings" not in c for c in chunks[:-2])

    chunks = stream(tiny_server, path, {**body, "stream_options": {"include_usage": True}})
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    check_timings(usage_chunk["timings"])


# ---------------------------------------------------------------------------------------------------
# Bad input: an OpenAI-style 4xx error that says what to fix, and the server keeps serving

C, CH = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]
BAD = [
    # (id, path, json body or raw bytes, status, words the message must contain)
    ("malformed-json", C, b'{"prompt": "hi", ', 400, ["not valid JSON"]),
    ("not-an-object", C, b'[1, 2]', 400, ["JSON object"]),
    ("empty-body", C, b"", 400, ["empty"]),
    ("wrong-type-max-tokens", C, {"prompt": "hi", "max_tokens": "lots"}, 400, ["max_tokens", "integer"]),
    ("wrong-type-temperature", CH, {"messages": OK_MSG, "temperature": "hot"}, 400, ["temperature"]),
    ("wrong-type-prompt", C, {"prompt": 5}, 400, ["prompt"]),
    ("wrong-type-messages", CH, {"messages": "hi"}, 400, ["messages"]),
    ("bad-role", CH, {"messages": [{"role": "robot", "content": "hi"}]}, 400, ["messages[0].role"]),
    ("missing-prompt", C, {"max_tokens": 5}, 400, ["prompt", "required"]),
    ("unknown-model", C, {"model": "gpt-9", "prompt": "hi"}, 404, ["model 'gpt-9' not found", "serves 'tiny'"]),
    ("unknown-model-chat", CH, {"model": "gpt-9", "messages": OK_MSG}, 404, ["gpt-9", "tiny"]),
    ("prompt-over-context", C, {"prompt": [5] * 5000}, 400, ["5000 tokens", "context length is 4096"]),
    ("prompt-plus-max-tokens", C, {"prompt": "hi", "max_tokens": 5000}, 400, ["max_tokens", "4096", "at most"]),
    ("max-tokens-zero", C, {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens must be at least 1"]),
    ("max-tokens-negative", CH, {"messages": OK_MSG, "max_tokens": -3}, 400, ["max_tokens must be at least 1"]),
    ("max-completion-tokens-zero", CH, {"messages": OK_MSG, "max_completion_tokens": 0}, 400,
     ["max_completion_tokens must be at least 1"]),
    ("n-2", C, {"prompt": "hi", "n": 2}, 400, ["n=2", "not supported"]),
    ("n-2-chat", CH, {"messages": OK_MSG, "n": 2}, 400, ["n=2", "not supported"]),
    ("empty-prompt", C, {"prompt": ""}, 400, ["prompt is empty"]),
    ("empty-token-prompt", C, {"prompt": []}, 400, ["prompt is empty"]),
    ("empty-messages", CH, {"messages": []}, 400, ["messages", "at least 1"]),
    ("batched-prompts", C, {"prompt": ["a", "b"]}, 400, ["batched", "one request per prompt"]),
    ("token-out-of-vocab", C, {"prompt": [1, 2, 10**6]}, 400, ["1000000", "vocabulary"]),
    ("negative-temperature", C, {"prompt": "hi", "temperature": -1}, 400, ["temperature must be >= 0"]),
    ("logprobs", C, {"prompt": "hi", "logprobs": 2}, 400, ["logprobs", "not supported"]),
    ("echo", C, {"prompt": "hi", "echo": True}, 400, ["echo", "not supported"]),
    ("penalty", CH, {"messages": OK_MSG, "presence_penalty": 0.5}, 400, ["presence_penalty", "not supported"]),
    ("image-content", CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, ["image_url", "not supported"]),
]


@pytest.mark.parametrize("path,body,status,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(tiny_server, path, body, status, words):
    r = post(tiny_server, path, content=body) if isinstance(body, bytes) else post(tiny_server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    for word in words:
        assert word in err["message"], (word, err["message"])
    assert "Traceback" not in r.text


def test_errors_through_the_sdk(client, model):
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported"):
        client.completions.create(model=model, prompt="hi", n=3)
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny'"):
        client.chat.completions.create(model="nope", messages=OK_MSG)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=model, prompt="hi", max_tokens=10_000)


def test_unknown_route_and_method(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.get(tiny_server.url + "/v1/completions")
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]


def test_still_serving_after_errors(client, model, tiny_server):
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    wait_idle(tiny_server)
    assert metric(tiny_server, "kvhandoff_requests_total", endpoint="/v1/completions", status="400") >= 10


# ---------------------------------------------------------------------------------------------------
# Disconnects free the request's blocks

def test_disconnect_mid_stream_frees_blocks(tiny_server):
    aborted = metric(tiny_server, "kvhandoff_requests_total", endpoint="/v1/completions", status="abort")
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()       # one iterator: discarding it would close the connection early
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        h = tiny_server.health()
        assert h["num_running"] == 1 and h["num_free_blocks"] < tiny_server.baseline["num_free_blocks"], h
    # Leaving the block closed the connection mid-stream: the server must abort and free the blocks.
    wait_idle(tiny_server)
    assert metric(tiny_server, "kvhandoff_requests_total", endpoint="/v1/completions", status="abort") == aborted + 1


def test_disconnect_non_streaming_frees_blocks(tiny_server):
    aborted = metric(tiny_server, "kvhandoff_requests_total", endpoint="/v1/chat/completions", status="abort")
    with pytest.raises(httpx.ReadTimeout):
        post(tiny_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": LONG, "ignore_eos": True},
             timeout=1.0)
    wait_idle(tiny_server)
    assert metric(tiny_server, "kvhandoff_requests_total", endpoint="/v1/chat/completions",
                  status="abort") == aborted + 1


# ---------------------------------------------------------------------------------------------------
# Metrics

def test_metrics(tiny_server):
    r = httpx.get(tiny_server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ["kvhandoff_requests_total", "kvhandoff_prompt_tokens_total", "kvhandoff_generation_tokens_total",
                 "kvhandoff_time_to_first_token_seconds_bucket", "kvhandoff_time_per_output_token_seconds_bucket",
                 "kvhandoff_e2e_request_latency_seconds_count", "kvhandoff_kv_blocks_used", "kvhandoff_kv_blocks_free",
                 "kvhandoff_kv_blocks_total", "kvhandoff_num_requests_running", "kvhandoff_num_requests_waiting"]:
        assert f"\n{name}" in r.text, name
    assert metric(tiny_server, "kvhandoff_requests_total", endpoint="/v1/completions", status="length") > 0
    assert metric(tiny_server, "kvhandoff_generation_tokens_total") > 0
    assert metric(tiny_server, "kvhandoff_time_to_first_token_seconds_count") > 0
    assert metric(tiny_server, "kvhandoff_kv_blocks_total") == 512


def test_a_ready_worker_has_its_whole_pool_in_memory(tmp_path):
    """Ready means serving at full speed: the pool's pages (512 MiB by default: 0.4-1.7 s to commit
    on a 2-core VM) are in before /health answers, not faulted in by the first requests' steps."""
    server = ServerProcess(["--model", "tiny"], tmp_path / "server.log")
    try:
        pool_kib = 512 * 1024
        resident = []
        with open(f"/proc/{server.proc.pid}/smaps") as smaps:
            size = 0
            for line in smaps:
                field = line.split()
                if field[0] == "Size:":
                    size = int(field[1])
                elif field[0] == "Rss:" and size >= pool_kib:
                    resident.append(int(field[1]))
        assert resident and max(resident) >= pool_kib, (resident, server.log_tail())
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------
# Shutdown

def test_sigterm_ends_requests_and_exits_cleanly(tmp_path):
    """SIGTERM aborts what is in flight (a stream ends with finish_reason 'abort', a waiting
    non-streaming request gets a 503), then the engine loop stops and the process exits 0."""
    server = ServerProcess(["--model", "tiny", "--num-blocks", "256"], tmp_path / "server.log")
    long = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(post, server, "/v1/completions", long)
            with httpx.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}, timeout=30) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                deadline = time.monotonic() + 20
                while server.health()["num_running"] < 2:   # both requests are in the engine
                    assert time.monotonic() < deadline and not plain.done(), server.log_tail()
                    time.sleep(0.05)
                server.proc.send_signal(signal.SIGTERM)
                rest = list(lines)                 # ends promptly: aborted, not run to LONG tokens
            finals = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
            assert finals and finals[-1]["choices"][0]["finish_reason"] == "abort"
            assert "data: [DONE]" in rest
            r = plain.result(timeout=15)
            assert r.status_code == 503 and "aborted" in r.json()["error"]["message"]
        assert server.proc.wait(15) == 0, server.log_tail()
        assert "engine stopped" in server.log_tail()
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------
# A real model

@pytest.mark.slow
def test_smollm2_knows_paris(tmp_path_factory):
    server = ServerProcess(["--model", "smollm2", "--num-blocks", "64"],
                           tmp_path_factory.mktemp("smollm2") / "server.log", timeout=600)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0)
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
        chunks = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
        assert server.stop() == 0
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------
# Last: nothing leaked over the whole session

def test_pool_back_to_baseline(tiny_server):
    h = wait_idle(tiny_server)
    assert h["num_free_blocks"] == h["num_blocks"] == tiny_server.baseline["num_free_blocks"]


def test_a_model_that_does_not_exist_is_one_line_not_a_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "serve", "--model", str(tmp_path / "no.gguf"),
                        "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("kvhandoff serve: error: model ") and "neither an alias" in r.stderr, r.stderr


def test_return_token_ids_gives_the_ids_a_client_resends(tiny_server):
    """vLLM's `return_token_ids`: the prompt's ids and the generated ones, streamed and not, on both
    endpoints; resent as a token-id prompt they are exactly the history (greedy continues alike)."""
    url, ids = tiny_server.url, [40, 41, 42, 43, 44, 45, 46]
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    choice = full["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == full["usage"]["completion_tokens"] == 12
    chunks = stream(tiny_server, "/v1/completions", body)[:-1]
    content = [c for c in chunks if c["choices"]]
    assert content[0]["choices"][0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in content[1:])
    assert [t for c in content for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in content) == choice["text"]
    # The history as ids: the prompt and the answer, continued by 6 more tokens, is the 18-token answer.
    longer = httpx.post(url + "/v1/completions", json=body | {"max_tokens": 18}, timeout=60).json()
    resent = httpx.post(url + "/v1/completions", json=body | {"prompt": ids + choice["token_ids"], "max_tokens": 6},
                        timeout=60).json()
    assert choice["token_ids"] + resent["choices"][0]["token_ids"] == longer["choices"][0]["token_ids"]
    plain = httpx.post(url + "/v1/completions", json=body | {"return_token_ids": False}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]

    chat = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert len(full["prompt_token_ids"]) == full["usage"]["prompt_tokens"] and len(full["choices"][0]["token_ids"]) == 8
    chunks = stream(tiny_server, "/v1/chat/completions", chat)[:-1]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"] and chunks[0]["choices"][0]["delta"]["role"]
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]
    assert tiny_server.health()["num_free_blocks"] == tiny_server.baseline["num_free_blocks"]
