"""Injected faults (issue 7, `kvhandoff serve --inject-faults`): a failed READ or WRITE, a lost `done`
or `release` notification. The affected request still ends with the right tokens (recompute), the
other side hears of failures at once where it can, and every pool returns to its baseline."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ServerProcess
from test_handoff import COMMON, HEADERS, PROMPTS, body, disaggregated, wait_baseline

# Short timeouts so the watchdog and lease paths run within the test.
FAST = ["--kv-timeout-s", "2", "--lease-s", "2"]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    logs = tmp_path_factory.mktemp("faults")
    started = [ServerProcess([*COMMON, "--role", role, *FAST], logs / f"{role}.log")
               for role in ("prefill", "decode", "both")]
    yield dict(zip(("prefill", "decode", "colocated"), started))
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
        kv = {"handoff_id": "write-fails", "mode": "push"}
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:      # both legs at once, as the router sends them
            p = pool.submit(httpx.post, f"{prefill.url}/v1/completions", headers=HEADERS, timeout=60,
                            json={**body(PROMPTS[2]), "kv_transfer_params": {**kv, "role": "prefill",
                                                                           "decode_url": decode.url}})
            d = pool.submit(httpx.post, f"{decode.url}/v1/completions", headers=HEADERS, timeout=60,
                            json={**body(PROMPTS[2]), "kv_transfer_params": {**kv, "role": "decode",
                                                                           "prefill_url": prefill.url}})
            r_prefill, r_decode = p.result(), d.result()
        assert r_prefill.status_code == 502 and "injected WRITE failure" in r_prefill.json()["error"]["message"]
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
