"""Worker-level handoffs over real processes, real HTTP and real transfer agents (docs/HANDOFF.md):
every mode reproduces colocated greedy output; failures recompute (or error) and never leak blocks.
The router's part is in test_router.py; here the test plays the router."""
from __future__ import annotations

import base64
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from conftest import ServerProcess, prefill_answer, prefill_handoff, stand_in_agent, start_servers
from kvhandoff.transfer.agent import TransferAgent
from kvhandoff.transfer.errors import PeerError
from kvhandoff.wire.auth import control_headers
from kvhandoff.wire.messages import PROTOCOL, PROTOCOL_VERSION

SECRET = "test-deployment-secret"
HEADERS = control_headers(SECRET)
COMMON = ["--model", "tiny", "--dtype", "float32", "--threads", "1", "--num-blocks", "256", "--kv-secret", SECRET]
MODES = ["pull", "pull-reader", "push", "push-layerwise"]


def words(n: int, seed: int) -> str:
    vocab = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
    return " ".join(vocab[(i * 7 + seed * 3) % len(vocab)] for i in range(n))


PROMPTS = [words(n, i) for i, n in enumerate([20, 60, 130, 250, 400, 700])]


def body(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}


@contextmanager
def three_workers(args: list[str], logs: Path):
    """A prefill, a decode and a colocated worker: {"prefill", "decode", "colocated"}."""
    # max_num_batched_tokens 64: long prompts prefill in chunks, which layer-wise push sends early.
    # The decode worker's pool is larger: a block's place in a layer-major pool depends on the
    # pool's size, which the messages carry with the block ids (kv_layout.py).
    extra = {"prefill": ["--max-num-batched-tokens", "64"], "decode": ["--num-blocks", "320"]}
    started = start_servers([([*args, "--role", role, *extra.get(role, [])], logs / f"{role}.log")
                             for role in ("prefill", "decode", "both")])
    try:
        yield dict(zip(("prefill", "decode", "colocated"), started))
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with three_workers(COMMON, tmp_path_factory.mktemp("handoff")) as started:
        yield started


@pytest.fixture(scope="module")
def reference(workers) -> list[str]:
    url = workers["colocated"].url
    return [httpx.post(f"{url}/v1/completions", json=body(p), timeout=60).json()["choices"][0]["text"]
            for p in PROMPTS]


def disaggregated(prefill: str, decode: str, mode: str, request: dict, timeout: float = 60) -> tuple[dict, dict]:
    """Play the router for one request; returns (prefill's handoff object, decode's response)."""
    handoff_id = uuid.uuid4().hex
    kv = {"handoff_id": handoff_id, "mode": mode, "protocol_version": PROTOCOL_VERSION}
    if mode.startswith("pull"):
        r = httpx.post(f"{prefill}/v1/completions", headers=HEADERS, timeout=timeout,
                       json={**request, "kv_transfer_params": {**kv, "role": "prefill"}})
        handoff = prefill_handoff(r)
        r2 = httpx.post(f"{decode}/v1/completions", headers=HEADERS, timeout=timeout,
                        json={**request, "kv_transfer_params": {**kv, "role": "decode", "remote": handoff}})
    else:
        with ThreadPoolExecutor(2) as pool:     # push: both sides at once, as the router does
            f1 = pool.submit(httpx.post, f"{prefill}/v1/completions", headers=HEADERS, timeout=timeout,
                             json={**request, "kv_transfer_params": {**kv, "role": "prefill", "decode_url": decode}})
            f2 = pool.submit(httpx.post, f"{decode}/v1/completions", headers=HEADERS, timeout=timeout,
                             json={**request, "kv_transfer_params": {**kv, "role": "decode", "prefill_url": prefill}})
            r, r2 = f1.result(), f2.result()
        handoff = prefill_handoff(r)
    assert r2.status_code == 200, r2.text
    return handoff, r2.json()


def wait_baseline(server: ServerProcess, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        idle = h["num_free_blocks"] == h["num_blocks"] and not h["num_pinned_handoffs"] and not h["num_quarantined"]
        if idle or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_colocated(workers, reference, mode):
    prefill, decode = workers["prefill"].url, workers["decode"].url
    with ThreadPoolExecutor(len(PROMPTS)) as pool:      # all in flight at once
        results = list(pool.map(lambda p: disaggregated(prefill, decode, mode, body(p)), PROMPTS))
    for (handoff, response), expected, prompt in zip(results, reference, PROMPTS):
        assert response["choices"][0]["text"] == expected
        decode_side = response["handoff"]
        assert decode_side["mode"] == mode and decode_side["kv_source"] == "remote"
        # Blocks the decode worker had already (its prefix cache: earlier tests sent these prompts) stay.
        local_blocks = decode_side["decode_cached_tokens"] // 32
        assert decode_side["bytes_transferred"] > 0 and decode_side["blocks"] + local_blocks == handoff.get(
            "blocks", len(handoff.get("block_ids", [])))
        phases = {**handoff["phases_ms"], **decode_side["phases_ms"]}
        assert {"prefill_queue", "prefill_compute", "transfer", "decode_queue", "first_step"} <= set(phases)
    for role in ("prefill", "decode"):
        h = wait_baseline(workers[role])
        assert h["num_free_blocks"] == h["num_blocks"], h


def test_every_mode_matches_colocated_in_bf16(tmp_path):
    """The same in bf16 (issue 25; the module's workers run fp32): KV handed over in bf16, decode rows
    through the bf16 kernels where they build, several requests in flight at once."""
    bf16 = [arg if arg != "float32" else "bfloat16" for arg in COMMON]
    with three_workers(bf16, tmp_path) as started:
        prefill, decode, colocated = (started[role].url for role in ("prefill", "decode", "colocated"))
        expected = [httpx.post(f"{colocated}/v1/completions", json=body(p), timeout=60).json()["choices"][0]["text"]
                    for p in PROMPTS]
        for mode in MODES:
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                results = list(pool.map(lambda p: disaggregated(prefill, decode, mode, body(p)), PROMPTS))
            assert [response["choices"][0]["text"] for _, response in results] == expected, mode
        assert all(server.health()["dtype"] == "bfloat16" for server in started.values())


def registration(agent: TransferAgent, handoff_id: str, **fields) -> dict:
    """A push registration notification naming `agent` as the decode worker's."""
    return {"kind": "register", "handoff_id": handoff_id, "mode": "push", "decode_worker": agent.name,
            "agent_metadata": base64.b64encode(agent.metadata()).decode(), "block_ids": [0], "pool_blocks": 8,
            "num_kv_tokens": 1, "prompt_hash": "x", "ttl_ms": 1000, **fields}


def answer_to(agent: TransferAgent, handoff_id: str, timeout: float = 10) -> dict:
    """The next notification `agent` receives about `handoff_id`."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        received = agent.wait_notification(left)
        if received is not None and json.loads(received[1]).get("handoff_id") == handoff_id:
            return json.loads(received[1])
    raise AssertionError(f"no notification about {handoff_id} in {timeout} s")


def test_handoffs_need_the_control_token(workers):
    request = body(PROMPTS[0], kv_transfer_params={"protocol_version": PROTOCOL_VERSION, "handoff_id": "x", "mode": "pull", "role": "prefill"})
    r = httpx.post(f"{workers['prefill'].url}/v1/completions", json=request, timeout=30)
    assert r.status_code == 401 and "control token" in r.json()["error"]["message"]
    wrong = control_headers("not-the-secret")
    assert httpx.get(f"{workers['prefill'].url}/kv/info", headers=wrong, timeout=30).status_code == 401
    r = httpx.post(f"{workers['colocated'].url}/v1/completions", json=request, headers=HEADERS, timeout=30)
    assert r.status_code == 400 and "colocated" in r.json()["error"]["message"]
    # Still serving plain requests afterwards; the refusals are logged, with the sender but no token.
    assert httpx.post(f"{workers['prefill'].url}/v1/completions", json=body("hello"), timeout=30).status_code == 200
    log = workers["prefill"].log_path.read_text()
    assert "rejected POST /v1/completions from 127.0.0.1: 401" in log and "rejected GET /kv/info" in log
    assert control_headers("not-the-secret")["Authorization"].split()[1] not in log


def test_another_protocol_version_is_refused(workers):
    """A router (or decode worker) of another kvhandoff version: a 400 that names both versions, not
    a handoff that half-works; the worker still serves."""
    for role in ("prefill", "decode"):
        params = {"handoff_id": f"v1-{role}", "mode": "push", "role": role, "protocol_version": 1,
                  "decode_url": workers["decode"].url, "prefill_url": workers["prefill"].url}
        r = httpx.post(f"{workers[role].url}/v1/completions", headers=HEADERS, timeout=30,
                       json={**body(PROMPTS[0]), "kv_transfer_params": params})
        assert r.status_code == 400 and "version 1" in r.json()["error"]["message"] and \
            f"speaks {PROTOCOL_VERSION}" in r.json()["error"]["message"], r.text
    # A decode worker of another version cannot register: its agent and ours do not connect (the
    # handshake's own refusal of a peer that hides its version: test_transfer.py).
    with pytest.raises(PeerError, match=f"speaks protocol '{PROTOCOL}', this agent 'kvhandoff-handoff/1'"):
        with stand_in_agent(workers["prefill"], SECRET, protocol="kvhandoff-handoff/1"):
            pass
    info = httpx.get(f"{workers['decode'].url}/kv/info", headers=HEADERS, timeout=10).json()
    assert info["protocol_version"] == PROTOCOL_VERSION
    assert httpx.post(f"{workers['prefill'].url}/v1/completions", json=body("still serving"), timeout=30).status_code == 200


def test_block_ids_outside_the_pool_they_name_are_refused(workers):
    """Block ids travel with their pool's size (a layer-major pool places a block by it): an id
    outside that pool, or a pool of no blocks, is refused with a reason that says so, on either side,
    before any transfer (a registration, which travels between the agents, is answered `failed`;
    the decode leg's handoff object is a 400); the workers go on serving."""
    with stand_in_agent(workers["prefill"], SECRET) as (agent, prefill):
        for pool_blocks, block_ids, why in ((4, [1, 4], "names block 4, outside its pool of 4 blocks"),
                                            (0, [0], "names a pool of 0 blocks")):
            handoff_id = f"bad-pool-{pool_blocks}"
            agent.send_notification(prefill, json.dumps(registration(
                agent, handoff_id, block_ids=block_ids, pool_blocks=pool_blocks, num_kv_tokens=40)).encode())
            note = answer_to(agent, handoff_id)
            assert note["kind"] == "failed" and f"the registration {why}" in note["reason"], note
    handoff, _ = disaggregated(workers["prefill"].url, workers["decode"].url, "pull", body(PROMPTS[1]))
    kv = {"handoff_id": "bad-pool-pull", "mode": "pull", "role": "decode", "protocol_version": PROTOCOL_VERSION,
          "remote": {**handoff, "block_ids": [handoff["pool_blocks"]] + handoff["block_ids"][1:]}}
    r = httpx.post(f"{workers['decode'].url}/v1/completions", headers=HEADERS, timeout=30,
                   json={**body(PROMPTS[1]), "kv_transfer_params": kv})
    assert r.status_code == 400 and "the handoff object names block" in r.json()["error"]["message"], r.text
    for role in ("prefill", "decode"):
        assert httpx.post(f"{workers[role].url}/v1/completions", json=body("still serving"), timeout=30).status_code == 200


def test_expired_lease_is_detected_and_recomputed(tmp_path, workers, reference):
    """Prefill frees the blocks when the lease runs out and reuses them; the decode side's READ then
    gets someone else's KV, which verification must catch (recompute: right tokens, no garbage)."""
    # 64 blocks: the prompt takes 51, so one 1,998-token filler must reuse most of them.
    prefill = ServerProcess([*COMMON, "--role", "prefill", "--lease-s", "0.5", "--num-blocks", "64"],
                            tmp_path / "prefill.log")
    try:
        r = httpx.post(f"{prefill.url}/v1/completions", headers=HEADERS, timeout=60,
                       json={**body(PROMPTS[4]), "kv_transfer_params": {"protocol_version": PROTOCOL_VERSION, "handoff_id": "late", "mode": "pull",
                                                                       "role": "prefill"}})
        handoff = prefill_handoff(r)
        h = wait_baseline(prefill, timeout=10)      # lease gone (0.5 s), blocks back in the pool...
        assert not h["num_pinned_handoffs"], h
        for i in range(2):                  # ...and overwritten by other prompts
            httpx.post(f"{prefill.url}/v1/completions", json=body(words(500, 10 + i), max_tokens=1), timeout=60)
        r = httpx.post(f"{workers['decode'].url}/v1/completions", headers=HEADERS, timeout=60,
                       json={**body(PROMPTS[4]), "kv_transfer_params": {"protocol_version": PROTOCOL_VERSION, "handoff_id": "late", "mode": "pull",
                                                                       "role": "decode", "remote": handoff}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[4]
        report = r.json()["handoff"]
        assert report["kv_source"] == "recomputed" and "verification" in report["error"]
        assert wait_baseline(prefill)["num_free_blocks"] == 64
    finally:
        prefill.stop()
    h = wait_baseline(workers["decode"])
    assert h["num_free_blocks"] == h["num_blocks"]


def test_push_prefill_dies_before_writing(tmp_path, workers, reference):
    """Decode registers with a prefill worker that then dies: the decode side notices the peer is gone
    (its agent's connection dies: within seconds, not the 30 s KV timeout), recomputes, and frees the
    reserved blocks."""
    prefill = ServerProcess([*COMMON, "--role", "prefill"], tmp_path / "prefill.log")
    decode = workers["decode"].url
    try:
        request = {**body(PROMPTS[3]), "kv_transfer_params": {"protocol_version": PROTOCOL_VERSION, "handoff_id": "orphan", "mode": "push",
                                                              "role": "decode", "prefill_url": prefill.url}}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{decode}/v1/completions", json=request, headers=HEADERS, timeout=90)
            deadline = time.monotonic() + 30
            while workers["decode"].health()["num_waiting_for_kv"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)                 # the registration reaches the prefill worker
            prefill.proc.kill()             # no goodbye: the agent must notice on its own
            killed = time.monotonic()
            r = pending.result()
            noticed_s = time.monotonic() - killed
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[3]
        assert r.json()["handoff"]["kv_source"] == "recomputed"
        assert noticed_s < 5, f"the dead prefill was noticed after {noticed_s:.1f} s: by the watchdog, not the agent"
        assert "is gone" in r.json()["handoff"]["error"], r.json()["handoff"]
    finally:
        prefill.stop()
    h = wait_baseline(workers["decode"], timeout=30)
    assert h["num_free_blocks"] == h["num_blocks"] and h["num_quarantined"] == 0


def test_push_decode_dies_after_registering(tmp_path, workers):
    """The decode worker registers, then dies; the prefill worker still finishes the handoff's
    bookkeeping and its pool returns to baseline. (Over shm the WRITE may land in the dead worker's
    still-mapped segment before the agent notices the death, so the answer is a 502, ends with an
    error, or with a handoff object for a write nobody reads; either way nothing leaks and the client's stream, from the decode worker,
    has already failed.)"""
    decode = ServerProcess([*COMMON, "--role", "decode"], tmp_path / "decode.log")
    prefill = workers["prefill"]
    try:
        kv = {"handoff_id": "widowed", "mode": "push", "protocol_version": PROTOCOL_VERSION}
        with ThreadPoolExecutor(1) as pool:
            pool.submit(httpx.post, f"{decode.url}/v1/completions", headers=HEADERS, timeout=30,
                        json={**body(PROMPTS[2]), "kv_transfer_params": {**kv, "role": "decode",
                                                                       "prefill_url": prefill.url}})
            deadline = time.monotonic() + 30
            while decode.health()["num_waiting_for_kv"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            decode.proc.kill()
            time.sleep(0.5)
            r = httpx.post(f"{prefill.url}/v1/completions", headers=HEADERS, timeout=60,
                           json={**body(PROMPTS[2]), "kv_transfer_params": {**kv, "role": "prefill",
                                                                          "decode_url": decode.url}})
        # Refused before computing (its agent saw the death first: 502), or the first token went out
        # and the failed WRITE is the answer's last line, or the WRITE landed in the dead segment.
        if r.status_code == 502:
            assert "failed" in r.json()["error"]["message"], r.text
        else:
            first, handoff, error = prefill_answer(r)
            assert r.status_code == 200 and first is not None and (handoff is None) != (error is None), r.text
            assert error is None or "failed" in error["message"], r.text
    finally:
        decode.stop()
    h = wait_baseline(prefill)
    assert h["num_free_blocks"] == h["num_blocks"] and h["num_pinned_handoffs"] == 0


def test_router_reported_prefill_failure_acts_at_once(workers, reference):
    """/kv/failed: the router saw the push prefill fail. Decode must recompute now (not after its
    --kv-timeout-s of 30 s) and free the blocks it reserved; the control endpoint rejects bad input
    with 4xx, never 5xx."""
    decode = workers["decode"]
    # The prefill worker accepts the registration, but its prefill leg never comes: only the report can end it.
    request = {**body(PROMPTS[3]), "kv_transfer_params": {"protocol_version": PROTOCOL_VERSION, "handoff_id": "reported", "mode": "push",
                                                          "role": "decode", "prefill_url": workers["prefill"].url}}
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        pending = pool.submit(httpx.post, f"{decode.url}/v1/completions", json=request, headers=HEADERS, timeout=90)
        while decode.health()["num_waiting_for_kv"] == 0 and time.monotonic() < started + 30:
            time.sleep(0.05)
        bad = [({"reason": "no id"}, 400), (["not", "an", "object"], 400)]
        for payload, status in bad:
            assert httpx.post(f"{decode.url}/kv/failed", json=payload, headers=HEADERS, timeout=10).status_code == status
        assert httpx.post(f"{decode.url}/kv/failed", content=b"{not json", headers=HEADERS, timeout=10).status_code == 400
        assert httpx.post(f"{decode.url}/kv/failed", json={"handoff_id": "reported"}, timeout=10).status_code == 401
        assert httpx.post(f"{workers['prefill'].url}/kv/failed", json={"handoff_id": "reported"}, headers=HEADERS,
                          timeout=10).status_code == 400
        r = httpx.post(f"{decode.url}/kv/failed", headers=HEADERS, timeout=10,
                       json={"handoff_id": "reported", "reason": "prefill answered 500", "prefill_answered": True})
        assert r.status_code == 200 and r.json() == {"failed": True}
        response = pending.result()
        elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference[3]
    report = response.json()["handoff"]
    assert report["kv_source"] == "recomputed" and "router reported" in report["error"]
    assert elapsed < 25, f"decode waited {elapsed:.1f} s: it must not sit out its 30 s KV timeout"
    # A second report, or one for a handoff nobody waits for, changes nothing.
    again = httpx.post(f"{decode.url}/kv/failed", json={"handoff_id": "reported"}, headers=HEADERS, timeout=10)
    assert again.json() == {"failed": False}
    h = wait_baseline(decode)
    assert h["num_free_blocks"] == h["num_blocks"] and h["num_quarantined"] == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_cancel_that_overtakes_the_request_is_honoured(workers, mode):
    """The router's /kv/cancel can reach a worker before the request it cancels (one still queued for
    admission, or in transit): the request must then be refused, not computed and its KV pinned for
    nobody until a watchdog fires (CI once saw 2 prefill blocks pinned this way after a 429 flood)."""
    for role in ("prefill", "decode"):
        server = workers[role]
        handoff_id = f"cancelled-early-{mode}-{role}"
        r = httpx.post(f"{server.url}/kv/cancel", json={"handoff_id": handoff_id}, headers=HEADERS, timeout=10)
        assert r.status_code == 200
        peer = {"decode_url": workers["decode"].url} if role == "prefill" else {"prefill_url": workers["prefill"].url}
        kv = {"handoff_id": handoff_id, "mode": mode, "role": role, "protocol_version": PROTOCOL_VERSION, **peer}
        if role == "decode" and mode == "pull":
            metadata = httpx.get(f"{workers['prefill'].url}/kv/info", headers=HEADERS, timeout=10).json()["agent_metadata"]
            kv["remote"] = {"agent_metadata": metadata}
            r = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=30,
                           json={**body(PROMPTS[2]), "kv_transfer_params": kv})
            assert r.status_code == 400 and "prompt_token_ids" in r.json()["error"]["message"], r.text
            kv["remote"] |= {"prompt_token_ids": [1, 2], "num_kv_tokens": 2, "block_ids": [0], "pool_blocks": 8,
                             "checksums": [0]}
        r = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=30,
                       json={**body(PROMPTS[2]), "kv_transfer_params": kv})
        assert r.status_code == 409 and "cancelled" in r.json()["error"]["message"], r.text
        h = wait_baseline(server, timeout=5)
        assert h["num_free_blocks"] == h["num_blocks"] and not h["num_pinned_handoffs"], h
    assert httpx.post(f"{workers['prefill'].url}/v1/completions", json=body("still serving"), timeout=30).status_code == 200


@pytest.mark.parametrize("mode", ["push", "push-layerwise"])
def test_push_prompt_that_outlives_the_kv_timeout(tmp_path, reference, mode):
    """A prompt can take longer to compute than --kv-timeout-s (a long prompt on a slow CPU): while
    the prefill computes, it keeps the registration alive (`progress`, answered by `renew`), so decode
    neither gives up nor recomputes. Before the keep-alive every such push handoff was recomputed."""
    timeout = ["--kv-timeout-s", "1"]
    slow = ["--inject-faults", "step_ms=250", "--max-num-batched-tokens", "256"]     # 2,800 tokens: >= 2.75 s
    prefill, decode = start_servers([([*COMMON, "--role", "prefill", *timeout, *slow], tmp_path / "prefill.log"),
                                     ([*COMMON, "--role", "decode", *timeout], tmp_path / "decode.log")])
    try:
        handoff, response = disaggregated(prefill.url, decode.url, mode, body(PROMPTS[5]))
        assert handoff["phases_ms"]["prefill_compute"] > 2000, handoff      # two timeouts and more
        assert response["handoff"]["kv_source"] == "remote", response["handoff"]
        assert response["choices"][0]["text"] == reference[5]
        for server in (prefill, decode):
            h = wait_baseline(server)
            assert h["num_free_blocks"] == h["num_blocks"] and not h["num_quarantined"], h
    finally:
        prefill.stop()
        decode.stop()


def test_prefill_answer_opens_when_the_engine_takes_the_prompt(tmp_path):
    """The prefill leg's status line goes out as soon as the engine has taken the prompt, so that at
    the first token only its line crosses (docs/HANDOFF.md, "Pull and pull-reader"); what the engine
    refuses (a token id outside the vocabulary) is still an HTTP status, not a line after a 200."""
    prefill = ServerProcess([*COMMON, "--role", "prefill", "--max-num-batched-tokens", "64",
                             "--inject-faults", "step_ms=150"], tmp_path / "prefill.log")
    try:
        kv = {"handoff_id": uuid.uuid4().hex, "mode": "pull", "role": "prefill", "protocol_version": PROTOCOL_VERSION}
        started = time.perf_counter()
        # 250 words prefill in several chunks of 64 tokens, each step 150 ms late: the answer has
        # opened long before its first token.
        with httpx.stream("POST", f"{prefill.url}/v1/completions", headers=HEADERS, timeout=60,
                          json={**body(PROMPTS[3]), "kv_transfer_params": kv}) as r:
            opened = time.perf_counter() - started
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            lines = r.iter_lines()
            first = next(lines)
            first_at = time.perf_counter() - started
            rest = list(lines)
        assert '"first_token"' in first and any('"handoff"' in line for line in rest), (first, rest)
        assert first_at - opened > 0.3, f"the answer opened {opened:.3f} s in, its first token {first_at:.3f} s in"
        refused = httpx.post(f"{prefill.url}/v1/completions", headers=HEADERS, timeout=60,
                             json={**body([10 ** 9]), "kv_transfer_params": {**kv, "handoff_id": uuid.uuid4().hex}})
        assert refused.status_code == 400 and "error" in refused.json(), refused.text
        release = httpx.post(f"{prefill.url}/kv/release", headers=HEADERS, json={"handoff_id": kv["handoff_id"]},
                             timeout=10)
        assert release.status_code == 200, release.text
        assert wait_baseline(prefill)["num_free_blocks"] == 256
    finally:
        prefill.stop()
