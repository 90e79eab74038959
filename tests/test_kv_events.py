"""What the fleet holds, learned from events (issue 44): workers publish their prefix cache and retained
turns in vLLM's KV-event format, every router keeps an index from them, and no lookup is asked of a
worker on a request's path. Real workers, real routers, real ZMQ and HTTP."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq
from conftest import ServerProcess
from test_fleet import asked, indexed
from test_router import SECRET, start_router

from kvhandoff.engine.block_pool import hash_chain
from kvhandoff.router.kv_index import KVIndex
from kvhandoff.wire import kv_events as E
from kvhandoff.wire.auth import control_headers

CONTROL = control_headers(SECRET)
# Small pools: the workload below fills them several times over, so blocks are evicted (removed events).
WORKER = ("--model", "tiny", "--dtype", "float32", "--threads", "1", "--kv-secret", SECRET, "--num-blocks", "40")
VLLM_BATCH = Path(__file__).parent / "data" / "vllm-0.32" / "kv_events.msgpack"


def test_vllm_and_kvhandoff_read_each_others_event_batches():
    """A batch vLLM 0.32's own classes encoded (tests/data, recorded from vllm/distributed/kv_events.py)
    reads as ours, field for field, and ours encodes to the same tagged arrays: one format."""
    raw = VLLM_BATCH.read_bytes()
    batch = E.decoder.decode(raw)
    assert [type(e).__name__ for e in batch.events] == ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockRemoved"]
    stored = batch.events[1]
    assert stored.block_hashes == [b"\x01" * 32, b"\x02" * 32] and stored.token_ids == list(range(32))
    assert (stored.block_size, stored.medium, stored.session_id, batch.data_parallel_rank) == (16, "CPU", "conv-1", 0)
    assert batch.events[2].parent_block_hash == b"\x02" * 32
    assert E.encoder.encode(batch) == raw            # re-encoded byte for byte: same fields, order and tags
    # vLLM's token-indexed view: a router keys blocks by their tokens, whatever the publisher's hashes.
    index = KVIndex()
    index.apply("vllm", batch, None)
    assert index.cached_blocks(hash_chain(list(range(48)), 16)) == {"vllm": 2}     # its third block was removed
    assert index.cached_blocks(hash_chain(list(range(1, 48)), 16)) == {}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """(prefills, decodes): two of each, bidirectional decode workers (they retain turns); every second
    KV-event batch of prefill 1 is lost on the way (drop_events=2), which its routers must repair."""
    logs = tmp_path_factory.mktemp("kv-events")
    specs = [(["--role", "prefill"], "prefill-0"), (["--role", "prefill", "--inject-faults", "drop_events=2"], "prefill-1")]
    specs += [(["--role", "decode", "--bidirectional", "--retention-ttl", "60", "--num-blocks", "256"], f"decode-{i}")
              for i in range(2)]
    with ThreadPoolExecutor(len(specs)) as pool:
        started = [pool.submit(ServerProcess, [*WORKER, *extra], logs / f"{name}.log") for extra, name in specs]
    servers = [f.result() for f in started if f.exception() is None]
    try:
        if len(servers) < len(specs):
            raise next(f.exception() for f in started if f.exception() is not None)
        yield [s.url for s in servers[:2]], [s.url for s in servers[2:]]
    finally:
        for server in servers:
            server.stop()


def router(tmp_path: Path, workers, name: str, mode: str = "push"):
    (tmp_path / name).mkdir(exist_ok=True)
    prefills, decodes = workers
    return start_router(tmp_path / name, ",".join(prefills), ",".join(decodes), mode, "--health-interval", "0.2",
                        "--prefill-policy", "cache-aware", "--bidirectional", "--shared-sessions")


def held(url: str) -> dict:
    r = httpx.get(url + "/kv/held", headers=CONTROL, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def index_of(router_url: str, worker_url: str) -> dict:
    r = httpx.get(router_url + "/admin/kv-index", params={"url": worker_url}, headers=CONTROL, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def differences(router_url: str, urls: list[str]) -> dict:
    """Where the router's index and each worker's own view of what it holds differ (blocks, turns)."""
    found = {}
    for url in urls:
        mine, theirs = index_of(router_url, url), held(url)
        for what in ("blocks", "retained"):
            extra, missing = set(mine[what]) - set(theirs[what]), set(theirs[what]) - set(mine[what])
            if extra or missing:
                found[f"{url} {what}"] = {"only in the index": sorted(extra)[:3], "only on the worker": sorted(missing)[:3],
                                          "on the worker": len(theirs[what])}
    return found


def agree(router_url: str, urls: list[str], timeout: float) -> None:
    """Until the router's index holds, block for block and turn for turn, what each worker says it
    holds (events take a moment to travel); what still differs when the time is up fails the test."""
    deadline = time.monotonic() + timeout
    while found := differences(router_url, urls):
        assert time.monotonic() < deadline, f"{router_url}'s index differs from the workers': {found}"
        time.sleep(0.1)


def chat_turns(url: str, seed: int, turns: int) -> None:
    """A conversation (named or not) whose prompts grow by its answers; some share a system prompt."""
    rng = random.Random(seed)
    system = "You route requests. " * (12 if seed % 2 else 3)
    messages = [{"role": "system", "content": system}]
    headers = {"X-Session-Id": f"conv-{seed}"} if seed % 3 else {}
    for turn in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kv"])
                                                              for _ in range(rng.randint(20, 60)))})
        r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120,
                       json={"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})


def test_routers_index_what_workers_hold_from_their_events_and_never_ask(workers, tmp_path):
    """A mixed workload through two routers (chats, named and anonymous, with retained turns; prompts
    that share prefixes; pools small enough to evict): each router's index equals each worker's own
    view, block for block; neither router asked a worker anything on a request's path; the lost
    batches were found by their sequence numbers and replayed. A router started after all this has
    the same index from the replay within 1 s."""
    prefills, decodes = workers
    first, second = router(tmp_path, workers, "a"), router(tmp_path, workers, "b")
    late = None
    try:
        for r in (first, second):
            indexed(r.url)
        before = asked(prefills + decodes)
        urls = [first.url, second.url]
        with ThreadPoolExecutor(3) as pool:
            for done in [pool.submit(chat_turns, urls[seed % 2], seed, 3) for seed in range(9)]:
                done.result()
        assert asked(prefills + decodes) == before, "a router asked a worker on a request's path"
        for r in (first, second):
            agree(r.url, prefills + decodes, timeout=5)
        retained = sum(len(held(u)["retained"]) for u in decodes)
        assert retained >= 6, retained
        stats = httpx.get(decodes[0] + "/health", timeout=10).json()
        assert stats["kv_events"]["events"] > 0
        removed = httpx.get(first.url + "/metrics", timeout=10).text
        gaps = [line for line in removed.splitlines() if line.startswith("kvhandoff_router_kv_event_gaps{")]
        assert any(prefills[1] in line and float(line.split()[-1]) >= 1 for line in gaps), gaps
        # A router that starts now: its replay (a snapshot, or the buffered batches) gives the same index.
        started = time.monotonic()
        late = router(tmp_path, workers, "late")
        agree(late.url, prefills + decodes, timeout=10)
        ready_s = time.monotonic() - started
        feeds = httpx.get(late.url + "/health", timeout=10).json()["kv_index"]["feeds"]
        assert max(f["resync_ms"] for f in feeds.values()) < 1000, feeds
        print(f"late router: index complete {ready_s:.2f} s after its start (process start included)")
    finally:
        for r in (first, second, late):
            if r is not None:
                r.stop()


def test_a_router_restarted_mid_load_resyncs_within_a_second(workers, tmp_path):
    """Load runs through one router while another is killed and started again: the new one's feeds are
    synchronised within 1 s of its first poll, and once the load ends its index equals the workers'."""
    prefills, decodes = workers
    steady = router(tmp_path, workers, "steady")
    restarted = router(tmp_path, workers, "restarted")
    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        seed = 100
        while not stop.is_set():
            try:
                chat_turns(steady.url, seed, 2)
            except BaseException as e:       # (reported below: a failure must not hang the test)
                errors.append(e)
                return
            seed += 1
    thread = threading.Thread(target=load)
    thread.start()
    try:
        time.sleep(1.0)
        restarted.proc.kill()
        restarted.stop()
        restarted = router(tmp_path, workers, "restarted-again")
        started = time.monotonic()
        kv_index = indexed(restarted.url, timeout=10)
        synced_s = time.monotonic() - started
        assert max(f["resync_ms"] for f in kv_index["feeds"].values()) < 1000, kv_index["feeds"]
        time.sleep(1.0)
        stop.set()
        thread.join(120)
        assert not errors, errors
        agree(restarted.url, prefills + decodes, timeout=5)
        print(f"restarted router: every feed synchronised {synced_s * 1e3:.0f} ms after it answered")
    finally:
        stop.set()
        thread.join(120)
        steady.stop()
        restarted.stop()


def test_events_need_the_deployment_secret(workers):
    """The publisher is a CURVE server keyed by the secret: a subscriber with another secret reads nothing."""
    info = httpx.get(workers[0][0] + "/health", timeout=10).json()["kv_events"]
    context = zmq.Context()
    try:
        for secret, expect in ((b"not-the-secret", False), (SECRET.encode(), True)):
            dealer = context.socket(zmq.DEALER)
            E.secure_client(dealer, secret)
            dealer.linger = 0
            dealer.connect(f"tcp://127.0.0.1:{info['replay_port']}")
            dealer.send_multipart([b"", E.seq_bytes(0)])
            answered = bool(dealer.poll(1500))
            assert answered is expect, (secret, answered)
            if answered:
                _, topic, seq, payload = dealer.recv_multipart()
                assert isinstance(E.decoder.decode(payload), E.KVEventBatch) or seq == E.END_SEQ
            dealer.close()
    finally:
        context.destroy(linger=0)


def test_the_router_bench_routes_a_fleet_by_events_and_without_them_by_asking(tmp_path):
    """`python -m kvhandoff.bench.router --workers N`: instant workers that publish what they hold; the
    router asks none of them on the request path, and its index took their events. With --no-events
    the same load is routed as before events: every prefill and decode worker asked on each turn."""
    def run(*extra: str) -> dict:
        out = tmp_path / ("asking" if extra else "events")
        bench = subprocess.run([sys.executable, "-m", "kvhandoff.bench.router", "--modes", "push", "--workers", "4",
                                "--requests", "120", "--latency-requests", "10", "--concurrency", "4",
                                "--out", str(out), *extra], capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
        [result] = json.loads((out / "results.json").read_text())
        assert result["failed"] == 0 and result["workers"] == 4, result
        return result
    events = run()
    assert events["index"]["events"] > 0 and events["index"]["blocks"] > 0 and events["resync_ms"] is not None
    assert not any("/kv/" in path for path in events["worker_calls"]), events["worker_calls"]
    asking = run("--no-events")
    calls = asking["worker_calls"]
    assert calls.get("prefill /kv/prompt", 0) >= 2 and calls.get("decode /kv/retained/find", 0) >= 2, calls
