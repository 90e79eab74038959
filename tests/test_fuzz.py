"""Hostile input, generated (hypothesis): the public endpoints and the workers' control endpoints
answer every malformed or unexpected body with a 4xx (or a normal answer), never a 5xx, never a
crash, and nothing they were sent leaves a block behind."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ServerProcess
from kvhandoff.wire.auth import control_headers
from kvhandoff.wire.messages import PROTOCOL_VERSION

SECRET = "fuzz-secret"
HEADERS = control_headers(SECRET)
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                      max_leaves=12)
# Small, mostly-valid generation sizes keep the fuzzing fast; anything else is fair game.
max_tokens = st.one_of(st.integers(-5, 8), values)
messages = st.one_of(values, st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), values),
     "content": st.one_of(st.text(max_size=30), values)}), max_size=3))
COMMON = {"model": st.one_of(st.just("tiny"), values), "max_tokens": max_tokens, "temperature": values,
          "top_p": values, "top_k": values, "stream": st.one_of(st.booleans(), values), "stop": values,
          "seed": values, "n": values, "min_tokens": st.one_of(st.integers(-2, 4), values),
          "ignore_eos": values, "stream_options": values, "logprobs": values}


def bodies(extra: dict) -> st.SearchStrategy:
    fields = {**COMMON, **extra}
    return st.one_of(values, st.fixed_dictionaries({}, optional=fields))


def post(url: str, path: str, body, headers=None) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json", **(headers or {})},
                      timeout=60)


def assert_sane(r: httpx.Response) -> None:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        assert "error" in r.json(), r.text[:300]


def wait_idle(server: ServerProcess, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if (h["num_free_blocks"] == h["num_blocks"] and not h["num_pinned_handoffs"] and not h["num_running"]
                and not h["num_waiting"]) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    started = []
    try:
        for role in ("prefill", "decode"):
            started.append(ServerProcess(["--model", "tiny", "--num-blocks", "128", "--kv-secret", SECRET,
                                          "--role", role, "--bidirectional", "--kv-timeout-s", "3",
                                          "--lease-s", "3"], logs / f"{role}.log"))
        yield dict(zip(("prefill", "decode"), started))
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    """A server of its own, with a short context: a chat body without max_tokens generates to the end
    of the context (OpenAI's default), which on the tiny model's full context made this fuzzing take
    a minute and a half."""
    server = ServerProcess(["--model", "tiny", "--num-blocks", "128", "--max-model-len", "256"],
                           tmp_path_factory.mktemp("fuzz") / "public.log")
    yield server
    server.stop()


@FUZZ
@given(body=bodies({"prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-3, 700), max_size=20), values),
                    "echo": values, "suffix": values}))
def test_completions_never_5xx(public, body):
    assert_sane(post(public.url, "/v1/completions", body))


@FUZZ
@given(body=bodies({"messages": messages, "max_completion_tokens": max_tokens, "tools": values}))
def test_chat_never_5xx(public, body):
    assert_sane(post(public.url, "/v1/chat/completions", body))


def test_public_endpoints_leave_nothing_behind(public):
    """Runs after the two above (file order): whatever they sent, the pool is back at baseline."""
    for raw in (b"", b"{", b"[]", b"\xff\xfe", b'{"prompt": "x", "max_tokens": 1e309}'):
        assert_sane(post(public.url, "/v1/completions", raw))
    h = wait_idle(public)
    assert h["num_free_blocks"] == h["num_blocks"] and h["status"] == "ok"


CONTROL_PATHS = ["/kv/register", "/kv/rebind", "/kv/release", "/kv/cancel", "/kv/failed", "/kv/retained/lease",
                 "/kv/retained/release", "/kv/prompt"]
control_bodies = st.one_of(values, st.fixed_dictionaries({}, optional={
    "handoff_id": st.one_of(st.text(max_size=12), values), "retention_id": st.one_of(st.text(max_size=12), values),
    "num_blocks": st.one_of(st.integers(-3, 10**12), values), "agent_metadata": values,
    "block_ids": st.one_of(st.lists(st.integers(-5, 10**9), max_size=5), values),
    "num_kv_tokens": values, "prompt_hash": values, "ttl_ms": values, "skip_blocks": values,
    "binding": st.one_of(st.integers(-2, 3), values), "reason": values, "prefill_answered": values, "recompute": values, "endpoint": values, "request": values}))


@FUZZ
@given(path=st.sampled_from(CONTROL_PATHS), body=control_bodies, role=st.sampled_from(["prefill", "decode"]))
def test_control_endpoints_never_5xx(workers, path, body, role):
    assert_sane(post(workers[role].url, path, body, HEADERS))


@FUZZ
@given(params=values | st.fixed_dictionaries({}, optional={
    "handoff_id": st.text(max_size=8), "mode": st.one_of(st.sampled_from(["pull", "push", "push-layerwise"]), values),
    "role": st.one_of(st.sampled_from(["prefill", "decode"]), values), "remote": values,
    "prefill_url": values, "decode_url": values, "binding": values, "reuse": values, "retain": values, "supersedes": values,
    "protocol_version": st.one_of(st.just(PROTOCOL_VERSION), values)}),
    role=st.sampled_from(["prefill", "decode"]))
def test_kv_transfer_params_never_5xx(workers, params, role):
    body = {"model": "tiny", "prompt": "alpha bravo charlie", "max_tokens": 2, "kv_transfer_params": params}
    assert_sane(post(workers[role].url, "/v1/completions", body, HEADERS))


def test_control_fuzzing_leaves_nothing_behind(workers):
    for role, server in workers.items():
        h = wait_idle(server, timeout=30)
        assert h["num_free_blocks"] == h["num_blocks"] and not h["num_pinned_handoffs"], (role, h)
        assert h["status"] == "ok"
