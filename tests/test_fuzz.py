"""Hostile input, generated (hypothesis): the public endpoints (a server's and the router's), the
router's admin endpoints and the workers' control endpoints answer every malformed or unexpected
body, header, method or size with a 4xx (or a normal answer), never a 5xx, never a crash; nothing
they were sent leaves a block behind, and control messages naming a live handoff never make another
request's answer wrong."""
from __future__ import annotations

import base64
import json
import time
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import ServerProcess, prefill_handoff, stand_in_agent, start_servers
from kvhandoff.wire.auth import control_headers
from kvhandoff.wire.messages import PROTOCOL_VERSION
from test_router import ROUTER_READY, Proc

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
        if (h["num_free_blocks"] + h.get("num_retained_blocks", 0) == h["num_blocks"] and not h["num_pinned_handoffs"] and not h["num_running"]
                and not h["num_waiting"]) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    started = start_servers([(["--model", "tiny", "--num-blocks", "128", "--kv-secret", SECRET, "--role", role,
                               "--bidirectional", "--kv-timeout-s", "3", "--lease-s", "3"], logs / f"{role}.log")
                             for role in ("prefill", "decode")])
    try:
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


CONTROL_PATHS = ["/kv/rebind", "/kv/release", "/kv/cancel", "/kv/failed", "/kv/retained/lease",
                 "/kv/retained/release", "/kv/retained/find", "/kv/prompt"]
control_bodies = st.one_of(values, st.fixed_dictionaries({}, optional={
    "handoff_id": st.one_of(st.text(max_size=12), values), "retention_id": st.one_of(st.text(max_size=12), values),
    "num_blocks": st.one_of(st.integers(-3, 10**12), values), "agent_metadata": values,
    "block_ids": st.one_of(st.lists(st.integers(-5, 10**9), max_size=5), values),
    "pool_blocks": st.one_of(st.integers(-3, 10**12), values), "num_kv_tokens": values, "prompt_hash": values, "ttl_ms": values, "skip_blocks": values,
    "binding": st.one_of(st.integers(-2, 3), values), "reason": values, "prefill_answered": values, "recompute": values, "endpoint": values, "request": values,
    "session": values, "block_hashes": st.one_of(st.lists(st.text(max_size=8), max_size=4), values)}))


@FUZZ
@given(path=st.sampled_from(CONTROL_PATHS), body=control_bodies, role=st.sampled_from(["prefill", "decode"]))
def test_control_endpoints_never_5xx(workers, path, body, role):
    assert_sane(post(workers[role].url, path, body, HEADERS))


@FUZZ
@given(params=values | st.fixed_dictionaries({}, optional={
    "handoff_id": st.text(max_size=8), "mode": st.one_of(st.sampled_from(["pull", "push", "push-layerwise"]), values),
    "role": st.one_of(st.sampled_from(["prefill", "decode"]), values), "remote": values,
    "prefill_url": values, "decode_url": values, "binding": values, "reuse": values, "retain": values, "supersedes": values,
    "session": values,
    "protocol_version": st.one_of(st.just(PROTOCOL_VERSION), values)}),
    role=st.sampled_from(["prefill", "decode"]))
def test_kv_transfer_params_never_5xx(workers, params, role):
    body = {"model": "tiny", "prompt": "alpha bravo charlie", "max_tokens": 2, "kv_transfer_params": params}
    assert_sane(post(workers[role].url, "/v1/completions", body, HEADERS))


@st.composite
def registrations(draw) -> dict:
    """A push registration of typed, often out-of-range fields, one or two of them (or none) replaced
    by anything: most reach the checks behind the parser."""
    note = {"kind": "register", "handoff_id": draw(st.text(max_size=8)),
            "mode": draw(st.sampled_from(["push", "push-layerwise"])), "decode_worker": "d", "agent_metadata": "self",
            "block_ids": draw(st.lists(st.integers(-5, 300), max_size=5)), "pool_blocks": draw(st.integers(-3, 400)),
            "num_kv_tokens": draw(st.integers(-3, 100)), "prompt_hash": "x", "ttl_ms": draw(st.floats(allow_nan=True)),
            "skip_blocks": draw(st.integers(-2, 6)), "binding": draw(st.integers(-2, 3))}
    for field in draw(st.lists(st.sampled_from(sorted(note)), max_size=2, unique=True)):
        note[field] = draw(values)
    return note


# Registrations that parse but cannot stand, one per check the prefill makes: always sent (what the
# generator draws depends on what ran before it in the process), so that their answers can be counted.
VALID_REGISTRATION = {"kind": "register", "mode": "push", "decode_worker": "d", "agent_metadata": "self",
                      "block_ids": [0, 1, 2], "pool_blocks": 8, "num_kv_tokens": 40, "prompt_hash": "x", "ttl_ms": 1000}
REFUSED_REGISTRATIONS = [{**VALID_REGISTRATION, "handoff_id": f"refused-{i}", **broken} for i, broken in enumerate([
    {"ttl_ms": 0}, {"ttl_ms": -5}, {"ttl_ms": -0.001}, {"pool_blocks": -2}, {"skip_blocks": -1},
    {"skip_blocks": 3}, {"block_ids": []}, {"block_ids": [0, 8]}, {"block_ids": [-3]}, {"pool_blocks": 0}])]


# Any other notification, however malformed.
notes = st.one_of(values, st.fixed_dictionaries({"kind": st.one_of(st.sampled_from(
    ["failed", "cancel", "renew", "release", "done", "progress", "withdrawn"]), values)}, optional={
    "handoff_id": st.one_of(st.text(max_size=8), values), "reason": values, "checksums": values, "first_token": values}))


@pytest.fixture(scope="module")
def stand_in(workers):
    """An agent of the deployment connected to the prefill worker's, as a decode worker's is."""
    with stand_in_agent(workers["prefill"], SECRET) as connected:
        yield connected


def refused_examples(test):
    for note in REFUSED_REGISTRATIONS:
        test = example(note=dict(note))(test)
    return test


@FUZZ
@given(note=st.one_of(registrations(), notes))
@refused_examples
def test_notifications_from_a_peer_never_break_a_worker(workers, stand_in, note):
    """What an authenticated peer's agent sends (a push registration among them) is checked like any
    control message: dropped or refused, never a dead worker or a held block."""
    agent, prefill = stand_in
    if isinstance(note, dict) and note.get("agent_metadata") == "self":
        note["agent_metadata"] = base64.b64encode(agent.metadata()).decode()
    agent.send_notification(prefill, json.dumps(note, allow_nan=True).encode())
    assert workers["prefill"].health()["status"] == "ok"


def test_refused_registrations_were_answered(stand_in):
    """(After the fuzzing above, which sent REFUSED_REGISTRATIONS among its examples.) Registrations
    that parsed but could not stand were answered `failed` with the reason, as a decode worker needs
    to free its blocks at once."""
    agent, _ = stand_in
    answers, refused, deadline = [], [], time.monotonic() + 30     # (a loaded worker answers late)
    while len(refused) < 10 and (received := agent.wait_notification(max(0.0, deadline - time.monotonic()))):
        answers.append(json.loads(received[1]))
        if answers[-1]["kind"] == "failed" and "registration refused" in answers[-1]["reason"]:
            refused.append(answers[-1])
    assert len(refused) >= 10, answers[:20]


def test_control_fuzzing_leaves_nothing_behind(workers):
    for role, server in workers.items():
        h = wait_idle(server, timeout=30)
        assert h["num_free_blocks"] == h["num_blocks"] and not h["num_pinned_handoffs"], (role, h)
        assert h["status"] == "ok"


# ---------------------------------------------------------------------------------------------------
# The router: public endpoints (bodies, headers, methods, sizes), admin endpoints, and control messages
# that name a live handoff

COMPLETION_FIELDS = {"prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-3, 700), max_size=20), values),
                     "echo": values, "suffix": values}
CHAT_FIELDS = {"messages": messages, "max_completion_tokens": max_tokens, "tools": values}
HEADER_NAMES = ["X-Session-Id", "Authorization", "Accept", "Content-Type", "X-Request-Id", "Accept-Encoding",
                "X-Forwarded-For", "Cookie", "Connection"]
headers = st.dictionaries(st.one_of(st.sampled_from(HEADER_NAMES), st.from_regex(r"\AX-[A-Za-z0-9-]{1,12}\Z")),
                          # (what a client can send at all: printable ASCII, no white space at either end)
                          st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=40)
                          .map(str.strip),
                          max_size=4)
ROUTER_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/tiny", "/v1/models/x/y",
                "/health", "/metrics", "/admin/workers", "/kv/release", "/", "/nope"]


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    """A push router with --bidirectional (sessions, retention) over the fuzz's two workers."""
    proc = Proc(["router", "--prefill", workers["prefill"].url, "--decode", workers["decode"].url, "--mode", "push",
                 "--bidirectional", "--port", "0", "--request-timeout", "60"],
                tmp_path_factory.mktemp("fuzz") / "router.log", ROUTER_READY, env={"KVHANDOFF_SECRET": SECRET})
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.text(), proc.text()[-4000:]


@FUZZ
@given(chat=st.booleans(), completion=bodies(COMPLETION_FIELDS), chat_body=bodies(CHAT_FIELDS), extra=headers)
def test_router_public_endpoints_never_5xx(router, chat, completion, chat_body, extra):
    path, body = ("/v1/chat/completions", chat_body) if chat else ("/v1/completions", completion)
    assert_sane(post(router.url, path, body, extra))


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
       path=st.sampled_from(ROUTER_PATHS), query=st.dictionaries(st.sampled_from(["url", "role", "x"]),
                                                                 st.text(max_size=20), max_size=2),
       content=st.one_of(st.none(), st.binary(max_size=64)))
def test_router_methods_and_paths_never_5xx(router, method, path, query, content):
    r = httpx.request(method, router.url + path, params=query, content=content, timeout=60)
    assert r.status_code < 500, f"{method} {path}: {r.status_code} {r.text[:300]}"


def test_router_takes_a_huge_body_without_5xx(router):
    """2 MiB of prompt text (about a million tokens): refused as over the context, not a crash."""
    r = post(router.url, "/v1/completions", {"model": "tiny", "prompt": "a " * (1 << 20), "max_tokens": 2})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text[:300]


urls = st.one_of(st.sampled_from(["http://127.0.0.1:1", "127.0.0.1:2", "http://[::1]:3", "ftp://x", "", "http://",
                                  "http://127.0.0.1:1,http://127.0.0.1:2"]), values)


@FUZZ
@given(delete=st.booleans(), body=st.one_of(values, st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["prefill", "decode"]), values), "url": urls})), url=urls)
def test_router_admin_endpoints_never_5xx(router, workers, delete, body, url):
    if delete:
        r = httpx.delete(router.url + "/admin/workers", params={"url": url if isinstance(url, str) else json.dumps(url)},
                         headers=HEADERS, timeout=60)
    else:
        r = post(router.url, "/admin/workers", body, HEADERS)
    assert_sane(r)
    original = {workers["prefill"].url, workers["decode"].url}
    for worker in httpx.get(router.url + "/admin/workers", headers=HEADERS, timeout=10).json()["workers"]:
        if worker["url"] not in original:       # leave the pool as it was for the next example
            assert httpx.delete(router.url + "/admin/workers", params={"url": worker["url"]}, headers=HEADERS,
                                timeout=10).status_code == 200


def test_control_messages_naming_a_live_handoff_never_make_an_answer_wrong(workers, router, public):
    """A pull handoff pinned on the prefill worker, then every control endpoint of both workers fuzzed
    with its id: the decode that then reads it answers the colocated tokens (read, or recomputed if
    a message released it) or refuses an id a message ended; a request through the router answers
    the colocated tokens, and both pools return to baseline."""
    request = {"model": "tiny", "prompt": "delta echo foxtrot golf hotel india", "max_tokens": 8, "temperature": 0,
               "ignore_eos": True}
    expected = httpx.post(public.url + "/v1/completions", json=request, timeout=60).json()["choices"][0]["text"]
    handoff_id = "live-" + uuid.uuid4().hex
    kv = {"handoff_id": handoff_id, "mode": "pull", "protocol_version": PROTOCOL_VERSION}
    handoff = prefill_handoff(post(workers["prefill"].url, "/v1/completions",
                                   {**request, "kv_transfer_params": {**kv, "role": "prefill"}}, HEADERS))

    @FUZZ
    @given(path=st.sampled_from(CONTROL_PATHS), body=control_bodies, role=st.sampled_from(["prefill", "decode"]))
    def fuzz(path, body, role):
        if isinstance(body, dict):
            body["handoff_id"] = handoff_id
        assert_sane(post(workers[role].url, path, body, HEADERS))

    fuzz()
    # A /kv/cancel the fuzzing sent the decode worker ends the id there for good: a refusal saying so is
    # right; anything else must be colocated's tokens (read, or recomputed after a release).
    r = post(workers["decode"].url, "/v1/completions",
             {**request, "kv_transfer_params": {**kv, "role": "decode", "remote": handoff}}, HEADERS)
    if r.status_code == 409:
        assert f"handoff {handoff_id} already ended" in r.json()["error"]["message"], r.text[:500]
    else:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text[:500]
    r = httpx.post(router.url + "/v1/completions", json=request, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text[:500]
    # (The router's requests leave their conversations' KV retained on the decode worker, by design.)
    for role, server in workers.items():
        h = wait_idle(server, timeout=30)
        retained = h.get("num_retained_blocks", 0)
        assert h["num_free_blocks"] + retained == h["num_blocks"] and not h["num_pinned_handoffs"], (role, h)
