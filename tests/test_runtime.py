"""The handoff runtime in one process (tiny engine, a real transfer agent with no peer): one outcome
per handoff whatever races, an engine thread that never waits on the network, threads that start
only once everything exists, counters that count under concurrency."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from kvhandoff.config import EngineConfig
from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.loop import EngineLoop
from kvhandoff.engine.request import SamplingParams
from kvhandoff.transfer.agent import TransferAgent
from kvhandoff.wire import messages as M
from kvhandoff.wire.modes import Mode, Role
from kvhandoff.worker.app import build_handoff
from kvhandoff.worker.arrivals import Incoming
from kvhandoff.worker.config import HandoffConfig
from kvhandoff.worker.control import HTTPControl
from kvhandoff.worker.inflight import Counters
from kvhandoff.worker.kv_layout import KVLayout, block_checksums
from kvhandoff.worker.protocol import layers as L
from kvhandoff.worker.protocol.layers import MIN_WRITE_BYTES

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(params=[Role.DECODE])
def worker(request):
    """(engine loop, handoff, agent): a worker of the role the test names (indirect), without HTTP."""
    agent = TransferAgent("runtime-test", b"runtime-test-secret", protocol=M.PROTOCOL)
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_blocks=64),
                       kv_allocator=lambda nbytes: agent.allocate_region("kv", nbytes))
    loop = EngineLoop(engine)
    before = {t.name for t in threading.enumerate()}
    handoff = build_handoff(request.param, HandoffConfig(kv_timeout_s=5), "runtime-test", agent, loop,
                            b"runtime-test-secret")
    # Nothing runs before the handoff is whole and started (its threads used to start first).
    assert not any(t.name.startswith("kvh-") for t in threading.enumerate() if t.name not in before)
    handoff.start()
    loop.start()
    yield loop, handoff, agent
    loop.stop()
    handoff.close()
    agent.close()


def test_exactly_one_outcome_per_handoff(worker):
    """Arrival, failure, deadline, cancel and peer death race for a handoff: the table's claim lets
    exactly one of them decide it. (A failure racing an arrival once ran both: the engine got
    kv_failed then kv_ready for one request, and the counters counted it twice.)"""
    _, handoff, _ = worker
    n = 200
    incomings = [Incoming(f"race-{i}", 32, side=handoff.decode.pull, checksums=[], first_token=3) for i in range(n)]
    for incoming in incomings:
        handoff.table.add(incoming.handoff_id, incoming)
    before = handoff.counters.snapshot()
    start = threading.Barrier(2)

    def arrive():
        start.wait()
        for incoming in incomings:
            handoff.arrivals.arrived(incoming)

    def fail():
        start.wait()
        for incoming in incomings:
            handoff.arrivals.fail(incoming, "deadline")

    threads = [threading.Thread(target=arrive), threading.Thread(target=fail)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # What the engine was handed (its loop polls the same events: stop it taking them first).
    landed, lost = set(), set()
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        events = handoff.door.poll()
        landed |= {e.request_id for e in events.landed}
        lost |= {e.request_id for e in events.lost}
        time.sleep(0.01)
    after = handoff.counters.snapshot()
    decided = (after["handoffs"] - before["handoffs"]) + (after["failures"] - before["failures"])
    assert decided == n, f"{decided} outcomes for {n} handoffs"
    assert not landed & lost and len(landed | lost) <= n
    assert all(handoff.table.ended(i.handoff_id) for i in incomings) and not handoff.table.entries(Incoming)


def test_the_engine_thread_never_waits_on_the_network(worker):
    """A peer whose socket stalls stalls only the sender thread: the engine thread's hooks queue
    their notifications and go on. Here the Release that a failed pull READ owes its prefill cannot
    be sent, and the request still recomputes and finishes, and other requests keep running."""
    loop, handoff, agent = worker
    stalled, attempts = threading.Event(), []

    def stalled_send(peer, message):            # a socket whose peer reads nothing
        attempts.append(message)
        stalled.wait(60)
    agent.send_notification = stalled_send
    try:
        # A notification from the engine thread itself returns at once.
        started = time.monotonic()
        loop.call(lambda: handoff.mail.notify("ghost", M.Cancel(handoff_id="x"))).result(5)
        assert time.monotonic() - started < 0.5

        prompt = list(range(10, 110))
        remote = M.PullHandoff(prompt_token_ids=prompt, num_kv_tokens=len(prompt), block_ids=[0, 1, 2, 3],
                               pool_blocks=8, checksums=[0, 0, 0, 0], agent_metadata="", first_token_id=5)
        kv = M.PullDecodeParams(handoff_id="stalled", mode=Mode.PULL, role="decode",
                                protocol_version=M.PROTOCOL_VERSION, remote=remote)
        incoming = Incoming("stalled", len(prompt), peer="ghost", mode=Mode.PULL, remote_blocks=[0, 1, 2, 3],
                            remote_layout=handoff.door.layout.peer(8), checksums=[0, 0, 0, 0], first_token=5)
        outputs: dict[str, list] = {"stalled": [], "bystander": []}
        done = {name: threading.Event() for name in outputs}

        def collector(name):
            def on_output(out):
                outputs[name].append(out)
                if out.finished:
                    done[name].set()
            return on_output
        handoff.decode.pull.submit(kv, incoming, prompt, GREEDY, collector("stalled"))
        loop.submit("bystander", list(range(200, 260)), GREEDY, collector("bystander"))
        assert done["stalled"].wait(20) and done["bystander"].wait(20)
        final = outputs["stalled"][-1]
        assert final.finish_reason == "length" and final.handoff["kv_source"] == "recomputed"
        deadline = time.monotonic() + 5
        while len(attempts) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert attempts, "the sender never tried the notifications"
    finally:
        stalled.set()


def test_counters_count_under_concurrency():
    counters = Counters()
    threads = [threading.Thread(target=lambda: [counters.bump("bytes", 3) for _ in range(20000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counters.snapshot()["bytes"] == 8 * 20000 * 3


@pytest.mark.parametrize("worker", [Role.PREFILL], indirect=True)
@pytest.mark.parametrize("mode", [Mode.PULL, Mode.PUSH])
def test_a_cancel_racing_the_prompts_end_leaves_nothing_pinned(worker, mode):
    """The router cancels prefill legs (its client left, the decode worker refused it) at every point
    of their computation: however the cancel falls against the engine finishing the prompt, the
    blocks come back. (The engine thread checked that the handoff was still in flight, then pinned;
    a cancel in between saw nothing pinned yet, aborted a request that had just finished, and the pin
    stayed for good: a pinned handoff left after a backpressure flood, in CI.)"""
    import random

    loop, handoff, _ = worker
    side = handoff.prefill.of(mode)
    params_cls = M.PullPrefillParams if mode.is_pull else M.PushPrefillParams
    rng = random.Random(7)
    baseline = loop.stats()["num_free_blocks"]
    # What the engine thread reads of the table is a moment old by the time it acts on it (a thread
    # switch under load): made a few ms here, so that cancels land in that moment.
    table_get = handoff.table.get

    def stale_get(handoff_id):
        found = table_get(handoff_id)
        if threading.current_thread().name == "engine-loop":
            time.sleep(0.003)
        return found
    handoff.table.get = stale_get

    async def one(i: int) -> None:
        handoff_id = f"cancel-race-{mode.value}-{i}"
        kv = params_cls(handoff_id=handoff_id, mode=mode, role="prefill", protocol_version=M.PROTOCOL_VERSION)
        prompt = [rng.randrange(10, 200) for _ in range(rng.randrange(8, 40))]
        task = asyncio.ensure_future(side.prefill(kv, prompt, SamplingParams(max_tokens=4, temperature=0),
                                                  on_submitted=lambda: None, on_first=lambda out: None))
        await asyncio.sleep(rng.random() * 0.03)
        handoff.cancel(handoff_id)
        await asyncio.wait({task})
        task.exception() if not task.cancelled() else None      # a 409 or a pin released: both fine

    async def many() -> None:
        for start in range(0, 300, 10):
            await asyncio.gather(*(one(i) for i in range(start, start + 10)))
    asyncio.run(many())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (loop.stats()["num_pinned_handoffs"] or
                                           loop.stats()["num_free_blocks"] != baseline):
        time.sleep(0.05)
    stats = loop.stats()
    assert stats["num_pinned_handoffs"] == 0 and stats["num_free_blocks"] == baseline, stats


@pytest.mark.parametrize("raised", [
    AttributeError("'NoneType' object has no attribute 'getpeername'"),    # anyio, a socket closed mid-connect
    httpx.ConnectError("All connection attempts failed"), ConnectionResetError(104, "Connection reset by peer")])
def test_a_worker_dying_under_a_control_request_is_a_connection_error(raised):
    """Whatever the HTTP stack raises when the other worker dies under a control request, the caller
    gets a ConnectionError naming the worker (the decode side answers 502 or recomputes), never an
    exception that reaches the client as a 500. The AttributeError is what a CI run met: a push
    prefill worker SIGKILLed while a decode worker connected for its /kv/info."""
    def die(request: httpx.Request) -> httpx.Response:
        raise raised
    control = HTTPControl(b"runtime-test-secret")
    control.http = httpx.AsyncClient(transport=httpx.MockTransport(die))

    async def both() -> None:
        with pytest.raises(ConnectionError, match="worker http://127.0.0.1:9 unreachable"):
            await control.get("http://127.0.0.1:9", "/kv/info")
        with pytest.raises(ConnectionError):
            await control.post("http://127.0.0.1:9", "/kv/register", {"handoff_id": "h"})
        await control.http.aclose()
    asyncio.run(both())


def layerwise_writes(num_layers: int, token_bytes_per_layer: int, prompt_tokens: int, chunk_tokens: int) -> list:
    """The WRITEs layer-wise push queues while a prompt computes, chunk by chunk and layer by layer
    (each (first block, blocks, first layer, layers)); push's final WRITE takes the rest."""
    block_size = 32
    geometry = L.Geometry(num_layers, block_size * token_bytes_per_layer, block_size)
    plan, queued = L.Plan(skip_blocks=0), []
    for start in range(0, prompt_tokens, chunk_tokens):
        end = start + min(chunk_tokens, prompt_tokens - start)
        for layer in range(num_layers):
            plan, writes = L.on_layer(plan, layer, start, end, prompt_tokens, geometry)
            queued += [(w.blocks.start, len(w.blocks), w.first_layer, w.num_layers) for w in writes]
    return queued


def test_layerwise_writes_carry_at_least_a_mebibyte():
    """A WRITE costs the prefill's core ~0.2 ms whatever its size: layer-wise push groups layers so that
    each carries MIN_WRITE_BYTES (or a sixth of the layers, whichever is more), and a prompt whose last
    chunk would go in one WRITE anyway leaves it to push's final one."""
    tiny, smollm2_bf16 = (4, 512), (30, 768)         # layers, bytes of K and V per token and layer
    assert layerwise_writes(*tiny, prompt_tokens=501, chunk_tokens=512) == []     # 1 MiB in all: one WRITE
    # 1,002 tokens in chunks of 64 (128 KiB each): a WRITE per chunk after its last layer, but the last
    assert layerwise_writes(*tiny, prompt_tokens=1002, chunk_tokens=64) == [(2 * k, 2, 0, 4) for k in range(15)]
    # SmolLM2, 1,024 tokens in two chunks: 384 KiB a layer, so the sixth of the layers (5) is the bigger group
    writes = layerwise_writes(*smollm2_bf16, prompt_tokens=1024, chunk_tokens=512)
    assert [(first, count) for _, _, first, count in writes] == [(layer, 5) for layer in range(0, 30, 5)] * 2
    assert all(blocks * 32 * 768 * count >= MIN_WRITE_BYTES for _, blocks, _, count in writes)
    # 256 tokens: 192 KiB a layer, 6 layers a WRITE
    assert [count for *_, count in layerwise_writes(*smollm2_bf16, prompt_tokens=256, chunk_tokens=512)] == [6] * 5


def test_kv_layout_places_each_layer_of_a_block_by_its_pools_size():
    """The pool is layer-major: block_descs names, layer by layer, the range of each (layer, block),
    in a pool of any size (a peer's, KVLayout.peer, gives what that pool's own layout gives); a
    layer's adjacent blocks are adjacent ranges; ids outside the pool are found; a block's checksum
    covers every layer of it and nothing else."""
    layers, shape = 3, (2, 1, 2, 2)                     # K/V, kv_heads, block_size, head_dim
    pools = {n: torch.arange(layers * n * 8, dtype=torch.float32).view(layers, n, *shape) for n in (5, 9)}
    small = KVLayout.of(pools[5])
    assert small == KVLayout(5, layers * 8 * 4, layers) and small.layer_bytes == 32
    for n, pool in pools.items():
        layout = small.peer(n)
        assert layout == KVLayout.of(pool)
        ids, raw = [3, 1, 2], pool.view(-1).view(torch.uint8)
        descs = layout.block_descs(ids)
        assert len(descs) == layers * len(ids) and descs.names == ("kv",)
        for i, (offset, length) in enumerate(zip(descs.offset.tolist(), descs.length.tolist())):
            layer, block = divmod(i, len(ids))
            assert torch.equal(raw[offset:offset + length], pool[layer, ids[block]].reshape(-1).view(torch.uint8))
        two = layout.layer_descs([1, 2], 1, 2)            # layers 1 and 2 of blocks 1, 2
        assert two.offset.tolist() == [(n + 1) * 32, (n + 2) * 32, (2 * n + 1) * 32, (2 * n + 2) * 32]
        assert layout.out_of_range([0, n - 1]) is None and layout.out_of_range([0, n, -1]) == n
        assert layout.block_descs([]) == []
    sums = block_checksums(pools[5], [0, 1, 2])
    pools[5][2, 1, 1, 0, 1, 1] += 1                        # the last layer of block 1
    after = block_checksums(pools[5], [0, 1, 2])
    assert after[0] == sums[0] and after[2] == sums[2] and after[1] != sums[1]
