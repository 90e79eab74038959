"""Injected faults (issue 7, `kvhandoff serve --inject-faults`).

First one request at a time, worker to worker: a failed READ or WRITE, a lost `done` or `release`
notification. The affected request still ends with the right tokens (recompute), the other side hears
of failures at once where it can, and every pool returns to its baseline.

Then the matrix, through a real router with two prefill and two decode workers, one of them faulty:
each fault (a worker killed after registration, mid-transfer or mid-decode; transfers failing or
slow; notifications lost or late) in pull and push, with concurrent bystander requests. Every
request ends with the colocated tokens, or, if its decode worker died after it had streamed tokens,
with an error event naming that worker; pools return to baseline; no process is left behind."""
from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ServerProcess, prefill_answer, start_servers
from kvhandoff.wire.messages import PROTOCOL_VERSION
from test_handoff import COMMON, HEADERS, PROMPTS, SECRET, body, disaggregated, wait_baseline
from test_router import ROUTER_READY, Proc

# Short timeouts so the watchdog and lease paths run within the test.
FAST = ["--kv-timeout-s", "2", "--lease-s", "2"]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    logs = tmp_path_factory.mktemp("faults")
    roles = {"prefill": "prefill", "decode": "decode", "colocated": "both", "prefill2": "prefill", "decode2": "decode"}
    started = start_servers([([*COMMON, "--role", role, *FAST], logs / f"{name}.log") for name, role in roles.items()])
    yield dict(zip(roles, started))
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def reference(healthy) -> dict[int, str]:
    return {i: httpx.post(f"{healthy['colocated'].url}/v1/completions", json=body(PROMPTS[i]), timeout=60)
            .json()["choices"][0]["text"] for i in (2, 3, 4)}


def faulty(tmp_path, role: str, spec: str) -> ServerProcess:
    return ServerProcess([*COMMON, "--role", role, *FAST, "--inject-faults", spec], tmp_path / f"{role}-faulty.log")


def settled(*servers: ServerProcess) -> None:
    for server in servers:
        h = wait_baseline(server, timeout=15)
        assert h["num_free_blocks"] == h["num_blocks"] and not h["num_pinned_handoffs"] and not h["num_quarantined"], h


def test_failed_read_recomputes(tmp_path, healthy, reference):
    decode = faulty(tmp_path, "decode", "read_fail")
    try:
        _, response = disaggregated(healthy["prefill"].url, decode.url, "pull", body(PROMPTS[3]))
        assert response["choices"][0]["text"] == reference[3]
        report = response["handoff"]
        assert report["kv_source"] == "recomputed" and "injected READ failure" in report["error"]
        settled(healthy["prefill"], decode)         # the release went out although the READ failed
    finally:
        decode.stop()


def test_failed_write_is_told_at_once(tmp_path, healthy, reference):
    prefill = faulty(tmp_path, "prefill", "write_fail")
    decode = healthy["decode"]
    try:
        kv = {"handoff_id": "write-fails", "mode": "push", "protocol_version": PROTOCOL_VERSION}
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:      # both legs at once, as the router sends them
            p = pool.submit(httpx.post, f"{prefill.url}/v1/completions", headers=HEADERS, timeout=60,
                            json={**body(PROMPTS[2]), "kv_transfer_params": {**kv, "role": "prefill",
                                                                           "decode_url": decode.url}})
            d = pool.submit(httpx.post, f"{decode.url}/v1/completions", headers=HEADERS, timeout=60,
                            json={**body(PROMPTS[2]), "kv_transfer_params": {**kv, "role": "decode",
                                                                           "prefill_url": prefill.url}})
            r_prefill, r_decode = p.result(), d.result()
        # The prefill's answer had begun (its first token goes out before the WRITE): the failure is its last line.
        first, _, error = prefill_answer(r_prefill)
        assert r_prefill.status_code == 200 and first is not None and "injected WRITE failure" in error["message"]
        assert r_decode.status_code == 200 and r_decode.json()["choices"][0]["text"] == reference[2]
        report = r_decode.json()["handoff"]
        assert report["kv_source"] == "recomputed" and "prefill worker reported" in report["error"]
        assert time.monotonic() - started < 10      # told by the `failed` notification, not a watchdog
        settled(prefill, decode)
    finally:
        prefill.stop()


def test_lost_done_notification_hits_the_watchdog(tmp_path, healthy, reference):
    prefill = faulty(tmp_path, "prefill", "drop=done")
    try:
        started = time.monotonic()
        _, response = disaggregated(prefill.url, healthy["decode"].url, "push", body(PROMPTS[4]))
        assert response["choices"][0]["text"] == reference[4]
        report = response["handoff"]
        assert report["kv_source"] == "recomputed" and "no KV from the prefill worker" in report["error"]
        assert 1.5 < time.monotonic() - started < 20          # --kv-timeout-s 2, not forever
        settled(prefill, healthy["decode"])                  # set-aside blocks back after 2 x the ttl
    finally:
        prefill.stop()


def test_lost_release_is_covered_by_the_lease(tmp_path, healthy, reference):
    decode = faulty(tmp_path, "decode", "drop=release")
    try:
        _, response = disaggregated(healthy["prefill"].url, decode.url, "pull", body(PROMPTS[2]))
        assert response["choices"][0]["text"] == reference[2] and response["handoff"]["kv_source"] == "remote"
        settled(healthy["prefill"], decode)                  # the 2 s lease ran out instead
        metrics = httpx.get(f"{healthy['prefill'].url}/metrics", timeout=10).text
        assert 'kvhandoff_handoff_events_total{event="lease_expiries"}' in metrics
    finally:
        decode.stop()


def test_a_request_cancelled_while_its_kv_is_checked_frees_its_blocks_at_once(tmp_path, healthy):
    """Push: the Done is in and the KV being checked when the router gives up on the request. The
    engine sets the blocks aside (a WRITE might still land) and the check then finds the handoff
    ended; the Done it came with was the prefill's last word, so the blocks go back now, not at the
    settle time (2 x --kv-timeout-s, 60 s here). A chaos soak in CI once ended with such blocks aside."""
    decode = ServerProcess([*COMMON, "--role", "decode", "--inject-faults", "verify_ms=3000"], tmp_path / "decode.log")
    try:
        handoff_id = uuid.uuid4().hex
        kv = {"handoff_id": handoff_id, "mode": "push", "protocol_version": PROTOCOL_VERSION}
        with ThreadPoolExecutor(2) as pool:
            d = pool.submit(httpx.post, f"{decode.url}/v1/completions", headers=HEADERS, timeout=60,
                            json={**body(PROMPTS[2]), "kv_transfer_params": {**kv, "role": "decode",
                                                                           "prefill_url": healthy["prefill"].url}})
            r_prefill = httpx.post(f"{healthy['prefill'].url}/v1/completions", headers=HEADERS, timeout=60,
                                   json={**body(PROMPTS[2]), "kv_transfer_params": {**kv, "role": "prefill",
                                                                                  "decode_url": decode.url}})
            # The prefill answers once its WRITE is done and its Done sent: the decode side is checking.
            assert r_prefill.status_code == 200 and prefill_answer(r_prefill)[2] is None, r_prefill.text
            cancelled = time.monotonic()
            assert httpx.post(f"{decode.url}/kv/cancel", json={"handoff_id": handoff_id}, headers=HEADERS,
                              timeout=10).status_code == 200
            r_decode = d.result()
        assert r_decode.status_code == 503 and "aborted (cancelled by the router" in r_decode.text, r_decode.text
        h = wait_baseline(decode, timeout=20)
        assert h["num_free_blocks"] == h["num_blocks"] and not h["num_quarantined"], h
        assert time.monotonic() - cancelled < 20        # the 3 s check, not the 60 s settle time
    finally:
        decode.stop()


# ---------------------------------------------------------------------------------------------------
# The matrix: (mode, role of the faulty worker, --inject-faults spec)

KILLS = [("pull", "prefill", "kill_at=registered"), ("pull", "decode", "kill_at=registered"),
         ("pull", "decode", "kill_at=transfer"), ("pull", "decode", "kill_at=decode"),
         ("push", "prefill", "kill_at=registered"), ("push", "prefill", "kill_at=transfer"),
         ("push", "decode", "kill_at=registered"), ("push", "decode", "kill_at=decode")]
DEGRADED = [("pull", "decode", "read_fail"), ("push", "prefill", "write_fail"),
            ("pull", "decode", "slow_ms=300"), ("push", "prefill", "slow_ms=300"),
            ("pull", "decode", "drop=release"), ("push", "prefill", "drop=done"),
            ("pull", "decode", "delay_ms=300"), ("push", "prefill", "delay_ms=300")]
MATRIX_TOKENS = 48          # long enough that a decode worker killed after 4 tokens dies mid-stream
MATRIX_REQUESTS = 2 * len(PROMPTS)     # each prompt as a completion and as a chat
SHM_SEGMENT = re.compile(r"^kvh\.\d+\.(\d+)\.")


def matrix_body(i: int) -> dict:
    """Request i of the matrix: completions for even i, chat for odd i (a chat stream starts with a
    role-only chunk, which the router must not send twice when it retries)."""
    request = body(PROMPTS[(i // 2) % len(PROMPTS)], max_tokens=MATRIX_TOKENS)
    if i % 2:
        request["messages"] = [{"role": "user", "content": request.pop("prompt")}]
    return request


def path_of(request: dict) -> str:
    return "/v1/chat/completions" if "messages" in request else "/v1/completions"


@pytest.fixture(scope="module")
def matrix_reference(healthy) -> list[str]:
    answers = []
    for i in range(MATRIX_REQUESTS):
        request = matrix_body(i)
        choice = httpx.post(healthy["colocated"].url + path_of(request), json=request, timeout=60).json()["choices"][0]
        answers.append(choice["message"]["content"] if "messages" in request else choice["text"])
    return answers


def stream(url: str, request: dict) -> tuple[int, str, str | None, dict | None]:
    """(status, text, error message, handoff object) of one streamed completion or chat."""
    text, error, handoff, roles = "", None, None, 0
    with httpx.stream("POST", url + path_of(request), json={**request, "stream": True}, timeout=90) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, "", r.json()["error"]["message"], None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                roles += "role" in delta
                text += choice.get("text") or delta.get("content") or ""
            handoff = chunk.get("handoff", handoff)
    assert roles == ("messages" in request), f"{roles} role chunks in one stream"
    return 200, text, error, handoff


def watch_queues(servers: dict[str, ServerProcess], finished: threading.Event) -> list[str]:
    """Every 2 s until `finished`: each server's queues and free blocks (printed when a stream hung,
    to tell a stalled engine from a lost message)."""
    keys = ("num_running", "num_waiting", "num_waiting_for_kv", "num_free_blocks", "num_pinned_handoffs",
            "num_quarantined", "num_preemptions")
    started, samples = time.monotonic(), []
    while not finished.wait(2.0):
        for name, server in servers.items():
            try:
                h = server.health()
            except httpx.HTTPError as e:
                h = {"error": str(e)}
            samples.append(f"{time.monotonic() - started:5.1f}s {name}: " + " ".join(f"{k[4:]}={h.get(k)}" for k in keys))
    return samples


def our_children() -> set[int]:
    """PIDs of this test process's live children (zombies included: a child not reaped is left behind)."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == me:
                found.add(int(entry))
    return found


def mechanism(mode: str, role: str, spec: str, handoffs: list[dict], faulty: str) -> list[dict]:
    """The handoff objects that show the mechanism docs/RELIABILITY.md names for this row of the matrix
    (at least one must): a request moved off the faulty worker (`retried_elsewhere` or `migrated`
    naming it), the K/V recomputed (`kv_source`) where it could not come, or, where the fault only
    delays or loses a message the other side covers, a handoff through the faulty worker that completed."""
    def moved(h: dict) -> bool:
        return faulty in h.get("retried_elsewhere", "") or any(m["from"] == faulty for m in h.get("migrated", []))
    through = [h for h in handoffs if h.get(f"{role}_worker") == faulty]
    if spec == "kill_at=decode":
        return [h for h in handoffs if any(m["from"] == faulty for m in h.get("migrated", []))]
    if spec.startswith("kill_at") and (role == "decode" or mode == "pull"):
        return [h for h in handoffs if moved(h)]
    if spec.startswith("kill_at"):          # a push prefill: the decode worker computes the prompt itself
        return [h for h in handoffs if moved(h) or h["kv_source"] == "recomputed"]
    if spec in ("read_fail", "write_fail", "drop=done"):      # the K/V never comes (or never says it came)
        return [h for h in through if h["kv_source"] == "recomputed"]
    return [h for h in through if h["kv_source"] == "remote"]  # slow or late messages: still a transfer


@pytest.mark.parametrize("spec", ["kill_at=registered", "kill_at=transfer"])
def test_a_killed_push_prefill_gives_the_decode_blocks_back_at_once(tmp_path, spec):
    """The default --kv-timeout-s (a write deadline of 60 s): a push prefill worker that dies (its fault
    kills it) after the decode worker registered its blocks, or mid-WRITE. The decode worker computes
    the prompt itself, and its reserved blocks are free within seconds: its agent saw the prefill's
    agent die, whether that came before or after the router's report of the failure."""
    decode, prefill = start_servers([([*COMMON, "--role", "decode"], tmp_path / "decode.log"),
                                     ([*COMMON, "--role", "prefill", "--inject-faults", spec], tmp_path / "prefill.log")])
    router = Proc(["router", "--prefill", prefill.url, "--decode", decode.url, "--mode", "push", "--port", "0",
                   "--kv-secret", SECRET], tmp_path / "router.log", ROUTER_READY)
    try:
        request = body(PROMPTS[2], max_tokens=8)
        status, text, error, handoff = stream(router.url, request)
        assert prefill.proc.wait(10) is not None        # the fault fired
        # Killed mid-WRITE, the last layers' bytes and the Done can have gone out before the process died.
        sources = {"recomputed"} | ({"remote"} if spec == "kill_at=transfer" else set())
        assert (status, error) == (200, None) and handoff["kv_source"] in sources, (status, error, handoff)
        started = time.monotonic()
        h = wait_baseline(decode, timeout=10)
        assert h["num_free_blocks"] == h["num_blocks"] and not h["num_quarantined"], \
            (f"decode blocks still set aside {time.monotonic() - started:.1f} s after the request", h)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("mode,role,spec", KILLS + DEGRADED, ids=lambda v: str(v))
def test_fault_matrix(tmp_path, healthy, matrix_reference, mode, role, spec):
    before = our_children()
    # A decode worker killed mid-stream must still be streaming KILL_DELAY_S after its 4th token: with
    # the compiled kernels a tiny-model stream of 48 tokens can end sooner than that on a fast machine.
    longer_steps = ",step_ms=10" if spec == "kill_at=decode" else ""
    faulty = ServerProcess([*COMMON, "--role", role, *FAST, "--inject-faults", spec + longer_steps],
                           tmp_path / f"{role}-faulty.log")
    prefills = [faulty.url, healthy["prefill"].url] if role == "prefill" else [healthy["prefill"].url]
    decodes = [faulty.url, healthy["decode"].url] if role == "decode" else [healthy["decode"].url]
    if len(prefills) == 1:       # the other role gets a second healthy worker too: rotation has a choice
        prefills.append(healthy["prefill2"].url)
    else:
        decodes.append(healthy["decode2"].url)
    router = Proc(["router", "--prefill", ",".join(prefills), "--decode", ",".join(decodes), "--mode", mode,
                   "--port", "0", "--kv-secret", SECRET, "--health-interval", "0.5", "--request-timeout", "60"],
                  tmp_path / "router.log", ROUTER_READY)
    killed = spec.startswith("kill_at")
    try:
        with ThreadPoolExecutor(MATRIX_REQUESTS + 1) as pool:
            finished = threading.Event()
            watched = pool.submit(watch_queues, healthy, finished)
            try:
                results = list(pool.map(lambda i: stream(router.url, matrix_body(i)), range(MATRIX_REQUESTS)))
            finally:
                finished.set()
        if any(e is not None and "request-timeout" in e for _, _, e, _ in results):
            print("DEBUG the healthy workers' queues every 2 s while the streams ran:", *watched.result(), sep="\n  ")
            print("DEBUG router log:\n" + router.text()[-6000:])
            # What every worker logged about the handoffs that hung (their ids are in the router's log).
            stuck = set(re.findall(r"handoff (\w+): the stream did not end", router.text()))
            for name, server in [*healthy.items(), ("faulty", faulty)]:
                lines = [line for line in server.log_path.read_text(errors="replace").splitlines()
                         if any(handoff_id in line for handoff_id in stuck)]
                print(f"DEBUG {name} log on {sorted(stuck)}:", *lines[-40:], sep="\n  ")
        migrated = []
        for i, (status, text, error, handoff) in enumerate(results):
            assert error is None and status == 200 and text == matrix_reference[i], (i, status, text, error, handoff)
            if handoff.get("migrated"):     # only a stream whose decode worker died after the client's first token
                assert role == "decode" and killed, (i, handoff)
                (move,) = handoff["migrated"]
                assert move["from"] == faulty.url and move["to"] != faulty.url and move["tokens_sent"] >= 1, move
                assert faulty.url in move["reason"], move
                migrated.append(i)
        if killed:
            faulty.proc.wait(10)        # the fault fired (a worker killed at that phase, not stopped by us)
            workers = httpx.get(router.url + "/health", timeout=10).json()["workers"]
            assert [w["status"] for w in workers if w["url"] == faulty.url] == ["unreachable"], workers
        if spec == "kill_at=decode":
            assert migrated, "the decode worker died after every stream had finished: the fault tested nothing"
        shown = mechanism(mode, role, spec, [h for _, _, _, h in results], faulty.url)
        assert shown, f"no request shows what docs/RELIABILITY.md says this row does: {[h for *_, h in results]}"
        if spec.startswith("slow_ms"):
            slowed = [h["phases_ms"]["transfer"] for _, _, _, h in results if h[f"{role}_worker"] == faulty.url]
            assert slowed and min(slowed) >= 300, slowed      # the slow link shows where it belongs
        # The router still serves, and every pool, the survivors' and the faulty one's, is back at baseline.
        status, text, error, _ = stream(router.url, matrix_body(3))
        assert (status, text, error) == (200, matrix_reference[3], None)
        for server in [s for s in healthy.values()] + ([] if killed else [faulty]):
            h = wait_baseline(server, timeout=15)
            assert h["num_free_blocks"] == h["num_blocks"] and not h["num_pinned_handoffs"], h
            assert not h["num_quarantined"] and not h["num_waiting_for_kv"], h
    finally:
        assert router.stop() == 0, router.text()[-3000:]
        faulty.stop()
    assert our_children() == before        # the faulty worker and the router are gone, and reaped
    def leftover() -> list[str]:
        return [f for f in os.listdir("/dev/shm") if (m := SHM_SEGMENT.match(f)) and int(m[1]) == faulty.proc.pid]
    deadline = time.monotonic() + 10        # agents sweep dead owners' segments every 5 s
    while leftover() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftover(), f"the faulty worker's shared memory outlived it: {leftover()}"
