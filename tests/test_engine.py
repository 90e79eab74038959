"""Engine correctness on the seeded tiny model: batching, chunking, prefix caching and preemption
never change greedy tokens; sampling options do what they say; every block returns to the pool.

The engines under test run as users run them (fp32 on CPU: the compiled kernels of
kvhandoff.model.kernels where they build); the reference is the dense, unpaged recompute through
torch's own paths (an engine with cpu_kernels=False), so the kernels are checked against torch."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvhandoff.config import EngineConfig
from kvhandoff.engine.block_pool import STORED, BlockPool
from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.holds import Hold, set_aside_owner
from kvhandoff.engine.kv_connector import KVConnector, KVEvents, Lost
from kvhandoff.engine.loop import KV_EVENTS_EVERY_S, EngineLoop
from kvhandoff.engine.request import RequestState, SamplingParams
from kvhandoff.engine.sampler import greedy_tokens
from kvhandoff.model import kernels
from kvhandoff.model.llama import prompt_logits

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT_LENS = [5, 40, 64, 100, 33, 200, 7, 300]


def waited_for(condition, timeout: float = 10.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False): a state the engine
    loop's thread reaches, awaited instead of a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def make_engine(**overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", **overrides))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="module")
def torch_model():
    """The model on torch's paths only: what the references are computed with."""
    return make_engine(cpu_kernels=False).loaded.model


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    special = set(engine.eos_token_ids) | set(engine.tokenizer.all_special_ids)
    vocab = [t for t in range(engine.model_config.vocab_size) if t not in special]
    g = torch.Generator().manual_seed(1)
    return [[vocab[i] for i in torch.randint(0, len(vocab), (n,), generator=g).tolist()] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(torch_model, prompts) -> list[list[int]]:
    """Greedy continuation recomputed from scratch each token (no paging across steps, no batching)."""
    return [greedy_reference(torch_model, prompt) for prompt in prompts]


def test_reference_is_not_trivial(reference):
    # A model that repeats one token would make every equality below pass vacuously.
    assert all(len(set(out)) > 5 for out in reference)
    assert len({tuple(out) for out in reference}) == len(reference)


def test_each_alone_matches_reference(engine, prompts, reference):
    assert [engine.generate([p], GREEDY)[0] for p in prompts] == reference
    assert engine.num_free_blocks == engine.num_blocks


def test_batched_equals_alone(prompts, reference):
    engine = make_engine(enable_prefix_caching=False)
    assert engine.generate(prompts, GREEDY) == reference
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("budget", [16, 48, 97])
def test_chunked_prefill_equals_one_shot(prompts, reference, budget):
    engine = make_engine(enable_prefix_caching=False, max_num_batched_tokens=budget)
    assert engine.generate(prompts, GREEDY) == reference
    assert engine.num_free_blocks == engine.num_blocks


def staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The prompts arriving one step apart: each one's prefill shares its step with the decode rows of
    those before it, and every decode batch size from 1 to len(prompts) occurs."""
    outputs = {f"s{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, params)
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return list(outputs.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequences_tokens_do_not_depend_on_what_shares_its_steps(prompts, dtype):
    """Batch invariance of decode (issue 25), in both dtypes: each prompt alone, and the prompts
    arriving one step apart (decode batches of every size, a prefill beside decode rows), give the
    same greedy tokens, and so do all of them at once (their prompts in one step). (In bf16 on torch's
    paths, 4 of 15 streams once differed: decode rows and, where the model allows, prompt rows now go
    through the kernels one row at a time; test_kernels.py checks a token's logits bit for bit.)"""
    engine = LLMEngine(EngineConfig(model="tiny", dtype=dtype, enable_prefix_caching=False))
    alone = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert staggered(engine, prompts, GREEDY) == alone
    assert engine.generate(prompts, GREEDY) == alone
    assert engine.num_free_blocks == engine.num_blocks


def test_prefix_cache_hits_equal_misses(prompts, reference):
    engine = make_engine()
    first = engine.generate(prompts, GREEDY)
    hits_before = engine.pool.hits
    # Same prompts again, plus extensions of them that share the cached prefix.
    second = engine.generate(prompts, GREEDY)
    assert engine.pool.hits > hits_before
    assert first == second == reference
    extended = [p + r[:10] for p, r in zip(prompts, reference)]
    fresh = make_engine(enable_prefix_caching=False).generate(extended, GREEDY)
    assert engine.generate(extended, GREEDY) == fresh
    assert engine.num_free_blocks == engine.num_blocks


def greedy_reference(model, prompt: list[int], n: int = GREEDY.max_tokens) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(prompt_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def random_prompts(engine: LLMEngine, lengths: list[int], seed: int) -> list[list[int]]:
    special = set(engine.eos_token_ids) | set(engine.tokenizer.all_special_ids)
    vocab = [t for t in range(engine.model_config.vocab_size) if t not in special]
    g = torch.Generator().manual_seed(seed)
    return [[vocab[i] for i in torch.randint(0, len(vocab), (n,), generator=g).tolist()] for n in lengths]


def test_a_batch_of_16_different_lengths_equals_the_reference(engine, torch_model):
    """Decode reads each sequence's blocks in place (issue 12): 16 sequences of 16 lengths, some a
    block or less, some many blocks with a partial last one, decoded in one batch, give every token
    of the dense, unpaged reference."""
    lengths = [1, 2, 31, 32, 33, 64, 65, 90, 128, 150, 200, 255, 256, 257, 300, 333]
    batch = random_prompts(engine, lengths, seed=16)
    fresh = make_engine(enable_prefix_caching=False, max_num_seqs=16, max_num_batched_tokens=4096)
    assert fresh.generate(batch, GREEDY) == [greedy_reference(torch_model, p) for p in batch]
    assert fresh.num_free_blocks == fresh.num_blocks


@pytest.mark.parametrize("prefix_blocks,new_tokens", [(1, 1), (1, 40), (4, 5), (4, 97), (9, 32), (9, 200)])
def test_prefill_over_a_cached_prefix_equals_the_reference(engine, torch_model, prefix_blocks, new_tokens):
    """A prompt whose first blocks are in the prefix cache computes only its new tokens, attending to
    the cached ones: the same greedy tokens as the dense reference, at several prefix/new splits."""
    cached = make_engine()
    prefix_len = prefix_blocks * cached.block_size
    prompt = random_prompts(engine, [prefix_len + new_tokens], seed=prefix_blocks * 1000 + new_tokens)[0]
    cached.generate([prompt[:prefix_len]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    hits = cached.pool.hits
    assert cached.generate([prompt], GREEDY)[0] == greedy_reference(torch_model, prompt)
    assert cached.pool.hits - hits == prefix_blocks       # the whole prefix came from the cache
    assert cached.num_free_blocks == cached.num_blocks


def test_preemption_recomputes_identically(prompts, reference):
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    some = prompts[1:5]
    expected = make_engine().generate(some, params)
    engine = make_engine(num_blocks=12, max_num_batched_tokens=64)
    assert engine.generate(some, params) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_free_blocks == engine.num_blocks


def test_seeded_sampling_is_reproducible(engine, prompts):
    params = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = engine.generate(prompts[:3], params)
    b = engine.generate(prompts[:3], params)
    c = engine.generate(prompts[:3], SamplingParams(max_tokens=32, temperature=1.0, seed=8, ignore_eos=True))
    assert a == b
    assert a != c


def test_greedy_tokens_are_torch_argmax_to_the_index():
    """The sampler's argmax (the CPU kernels', else numpy's, for speed) picks what torch.argmax picks,
    also for ties (the first), NaN (the first NaN), infinities, a row masked to -inf throughout, and
    rows wider apart than their length (a slice of the logits)."""
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for trial in range(200):
            rows, vocab = 1 + trial % 17, 1 + int(torch.randint(1, 3000, (1,), generator=gen))
            logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()       # small ints: many ties
            specials = torch.tensor([float("nan"), float("inf"), float("-inf")])
            picks = torch.rand(rows, vocab, generator=gen)
            logits[picks < 0.01] = specials[trial % 3]
            if trial % 5 == 0:
                logits[0] = float("-inf")
            if trial % 7 == 0 and vocab > 1:
                logits = logits[:, :vocab - 1 - trial % (vocab - 1)]
            expected = logits.argmax(dim=-1).tolist()
            assert greedy_tokens(logits) == expected, trial
            assert logits.numpy().argmax(axis=-1).tolist() == expected, trial      # (the fallback)
            if kernels.available():
                assert kernels.argmax_rows(logits) == expected, trial


def test_the_block_pool_hands_out_blocks_freed_together_as_an_ascending_run():
    """allocate takes the least recently freed blocks (LRU: cached prefixes live longest) and returns
    them in ascending order: a finished sequence's blocks, released tail first, come back as one run
    of adjacent blocks, which the layer-major pool lays side by side for decode attention."""
    pool = BlockPool(num_blocks=12, block_size=4)
    first, second = pool.allocate(5), pool.allocate(4)
    assert first == [0, 1, 2, 3, 4] and second == [5, 6, 7, 8]
    pool.free_blocks(first)
    pool.free_blocks(second)
    assert pool.allocate(3) == [9, 10, 11]          # never used: freed longest ago
    assert pool.allocate(5) == [0, 1, 2, 3, 4]      # the first sequence's, whole
    assert pool.allocate(2) == [7, 8]               # the second's, its tail first
    assert pool.num_free == 2


def test_top_k_one_is_greedy(engine, prompts, reference):
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=1, seed=3, ignore_eos=True)
    assert engine.generate(prompts[:2], params) == reference[:2]


def test_eos_min_tokens_and_ignore_eos(engine, prompts, reference):
    eos = engine.eos_token_ids[0]
    # Make one of the reference's tokens a stop token: generation ends where it first appears...
    stop_token = reference[0][4]
    first = reference[0].index(stop_token)
    stop_at = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token])
    assert engine.generate([prompts[0]], stop_at)[0] == reference[0][:first + 1]
    # ...unless min_tokens forbids stopping that early.
    held = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token], min_tokens=10)
    out = engine.generate([prompts[0]], held)[0]
    assert len(out) >= 10 and stop_token not in out[:10]
    assert eos not in engine.generate([prompts[0]], SamplingParams(max_tokens=40, temperature=0, min_tokens=40))[0]


def test_stop_string_cuts_text(engine):
    text_prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    free_run = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    req_text = engine.tokenizer.decode(engine.generate([text_prompt], free_run)[0])
    assert len(req_text) > 6
    stop = req_text[3:6]
    engine.add_request("stop-test", text_prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))
    pieces, finish = [], None
    while finish is None:
        for out in engine.step():
            pieces.append(out.new_text)
            finish = out.finish_reason if out.finished else None
    text = "".join(pieces)
    assert finish == "stop"
    assert stop not in text and req_text.startswith(text) and len(text) == req_text.find(stop)
    assert engine.num_free_blocks == engine.num_blocks


def test_invalid_requests_are_refused(engine, prompts):
    with pytest.raises(ValueError, match="maximum context length"):
        engine.validate(prompts[0], SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.validate(prompts[0], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="empty"):
        engine.validate([], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.validate([engine.model_config.vocab_size], SamplingParams())


def test_loop_streams_and_abort_frees_blocks(engine, prompts, reference):
    loop = EngineLoop(engine)
    loop.start()
    try:
        done = {i: threading.Event() for i in range(3)}
        tokens = {i: [] for i in range(3)}
        finish = {}

        def collector(i):
            def on_output(out):
                tokens[i] += out.new_token_ids
                if out.finished:
                    finish[i] = out
                    done[i].set()
            return on_output

        long = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
        loop.submit("r0", prompts[0], GREEDY, collector(0))
        loop.submit("r1", prompts[1], long, collector(1))
        loop.submit("r2", prompts[2], GREEDY, collector(2))
        assert done[0].wait(60) and done[2].wait(60)
        loop.abort("r1")
        assert done[1].wait(60)
        assert tokens[0] == reference[0] and tokens[2] == reference[2]
        assert finish[1].finish_reason == "abort" and 0 < len(tokens[1]) < 2000
        assert finish[0].timings["ttft_ms"] > 0 and finish[0].timings["decode_ms"] >= 0
    finally:
        loop.stop()
    assert engine.num_free_blocks == engine.num_blocks


def test_loop_failure_fails_requests_instead_of_hanging(prompts):
    engine = make_engine(num_blocks=64)
    loop = EngineLoop(engine)

    def broken_step():
        raise RuntimeError("scheduler bug")

    engine.step = broken_step
    finished = threading.Event()
    result = {}

    def on_output(out):
        result["out"] = out
        finished.set()

    loop.start()
    try:
        loop.submit("doomed", prompts[0], GREEDY, on_output)
        assert finished.wait(30)
        assert result["out"].finish_reason == "error" and "scheduler bug" in result["out"].error
        assert not loop.is_alive()
        with pytest.raises(RuntimeError, match="scheduler bug"):
            loop.submit("late", prompts[0], GREEDY, on_output)
    finally:
        loop.stop()


def test_a_busy_loop_hands_its_kv_events_on_in_batches_and_every_one_before_it_sleeps(prompts):
    """Each hand-over wakes a worker's event publisher, which then takes the engine's core: while the
    engine has work, its pool's events are gathered for KV_EVENTS_EVERY_S at a time; once it has none,
    whatever is left goes at once (a router must not wait for a quiet worker's last events)."""
    engine = make_engine(num_blocks=64)
    loop = EngineLoop(engine)
    handed = []
    loop.on_kv_events = lambda events: handed.append((time.monotonic(), list(events)))
    finished = threading.Event()
    loop.start()
    try:
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        loop.submit("long", prompts[1], params, lambda out: out.finished and finished.set())
        assert finished.wait(60) and waited_for(lambda: loop.asleep)
        times = [at for at, _ in handed]
        # (the last one may come sooner: the engine ran out of work)
        assert all(later - earlier >= KV_EVENTS_EVERY_S for earlier, later in zip(times[:-2], times[1:-1])), times
        # A short request (a few ms) stores the blocks of its prompt: they go as the loop falls asleep.
        finished.clear()
        loop.submit("short", prompts[3], SamplingParams(max_tokens=2, temperature=0), lambda out: out.finished and finished.set())
        assert finished.wait(60) and waited_for(lambda: loop.asleep)
        stored = [event for _, events in handed for event in events if event[0] == STORED]
        assert stored and stored == engine.pool.snapshot() and not engine.pool.events
    finally:
        loop.stop()


def test_the_loop_computes_with_the_engines_threads_and_the_loading_thread_keeps_one():
    """The engine's threads are the loop thread's alone: a second OpenMP team on the loading thread
    made libgomp stop spinning on a 2-core machine (LLMEngine.__init__), and two threads decoded
    slower than one."""
    engine = make_engine(num_blocks=16, threads=2)
    assert engine.threads == 2 and torch.get_num_threads() == 1
    loop = EngineLoop(engine)
    loop.start()
    try:
        assert loop.call(torch.get_num_threads).result(timeout=30) == 2
    finally:
        loop.stop()
    assert torch.get_num_threads() == 1


def run_until_finished(engine: LLMEngine, request_id: str, max_steps: int = 5000):
    tokens = []
    for _ in range(max_steps):
        assert engine.has_work(), f"{request_id} is stuck: the engine has nothing to run"
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                if out.finished:
                    return tokens, out
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


class Recorder(KVConnector):
    """A connector that only records what the engine's hooks tell it; the test plays the transfers
    and hands the outcomes back through poll(), as a real connector does."""

    def __init__(self):
        self.reservations: dict[str, list[int]] = {}
        self.events = KVEvents()

    def reserved(self, request, num_local_tokens: int) -> None:
        self.reservations[request.request_id] = list(request.block_table)

    def finished(self, request, out) -> bool:
        return True                     # prefill-only requests stay pinned until the test releases them

    def poll(self) -> KVEvents:
        events, self.events = self.events, KVEvents()
        return events

    def has_events(self) -> bool:
        return bool(self.events)


class Collected:
    """An EngineLoop output callback that keeps what it gets: tokens, outputs, `finished` once done."""

    def __init__(self):
        self.tokens, self.outputs, self.finished = [], [], threading.Event()

    def __call__(self, out) -> None:
        self.tokens.extend(out.new_token_ids)
        self.outputs.append(out)
        if out.finished:
            self.finished.set()


def connected(**overrides) -> LLMEngine:
    engine = make_engine(**overrides)
    engine.connect(Recorder())
    return engine


def reserve(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
            num_kv_tokens: int) -> list[int] | None:
    """Queue a remote-KV request and let one step's remote-KV section try to reserve its blocks."""
    engine.add_request(request_id, prompt, params, remote_tokens=num_kv_tokens)
    engine.step()
    return engine.connector.reservations.get(request_id)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_handoff_hooks_copy_kv_between_engines(prompts, reference, prefix_caching):
    """Prefill-only on one engine, KV copied block by block into another engine's reserved blocks,
    decode there: the tokens equal colocated decoding (the engine half of every handoff mode)."""
    prefill = connected(num_blocks=64, max_num_batched_tokens=48, enable_prefix_caching=prefix_caching)
    decode = connected(num_blocks=64, enable_prefix_caching=prefix_caching)
    for rounds in range(2 if prefix_caching else 1):        # round 2 hits the prefill's prefix cache
        for i, prompt in enumerate(prompts):
            handoff_id = f"h{rounds}-{i}"
            assert handoff(prefill, decode, handoff_id, prompt, GREEDY) == reference[i], f"prompt {i}"
    assert prefill.num_free_blocks == prefill.num_blocks and decode.num_free_blocks == decode.num_blocks


def handoff(prefill, decode, handoff_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Prefill-only on one engine, its KV copied into the other's reserved blocks, decode there."""
    prefill.add_request(handoff_id, prompt, params, prefill_only=True)
    _, done = run_until_finished(prefill, handoff_id)
    assert done.finish_reason == "prefilled" and done.num_kv_tokens == len(prompt)
    assert len(done.new_token_ids) == 1            # the prefill samples the first token itself
    dest = reserve(decode, handoff_id, prompt, params, done.num_kv_tokens)
    assert len(dest) == len(done.kv_block_ids)
    decode.runner.kv_cache[:, dest] = prefill.runner.kv_cache[:, done.kv_block_ids]
    assert prefill.release(handoff_id)
    first = decode.kv_ready(handoff_id, done.new_token_ids[0])
    assert first.new_token_ids == done.new_token_ids    # emitted at once, before any decode step
    if first.finished:
        return first.new_token_ids
    tokens, _ = run_until_finished(decode, handoff_id)
    return first.new_token_ids + tokens


def test_handoff_keeps_seeded_sampling_and_short_answers(prompts):
    """A seeded, sampled request gives the same tokens handed off as colocated (the decode side
    skips the draw the prefill made), and a one-token answer finishes with the KV's arrival."""
    colocated, prefill, decode = make_engine(num_blocks=64), connected(num_blocks=64), connected(num_blocks=64)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=7, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for k, (prompt, params) in enumerate([(prompts[2], sampled), (prompts[4], sampled), (prompts[1], one)]):
        expected = colocated.generate([prompt], params)[0]
        assert handoff(prefill, decode, f"s{k}", prompt, params) == expected
    for engine in (prefill, decode):
        assert engine.num_free_blocks == engine.num_blocks and not engine.holds.count(Hold.PINNED)


def test_kv_failure_recomputes_or_errors(prompts, reference):
    decode = connected(num_blocks=64)
    prompt = prompts[3]
    reserve(decode, "lost", prompt, GREEDY, len(prompt))
    assert decode.num_free_blocks < decode.num_blocks
    # The reserved blocks hold garbage (nothing arrived): recompute must ignore them entirely.
    assert decode.kv_failed("lost", recompute=True, reason="lease expired") is None
    tokens, out = run_until_finished(decode, "lost")
    assert tokens == reference[3] and out.finish_reason == "length"
    reserve(decode, "failed", prompt, GREEDY, len(prompt))
    out = decode.kv_failed("failed", recompute=False, reason="transfer failed")
    assert out.finish_reason == "error" and "transfer failed" in out.error
    assert decode.num_free_blocks == decode.num_blocks


def test_reserve_refuses_when_pool_is_full(prompts):
    decode = connected(num_blocks=12)
    assert len(reserve(decode, "first", prompts[5], GREEDY, 200)) == 7
    assert reserve(decode, "big", prompts[7], GREEDY, 300) is None
    # Nothing taken for it: it waits, holding no block, until the pool has room.
    assert decode.num_free_blocks == 5 and decode.requests["big"].state is RequestState.WAITING_REMOTE
    decode.kv_failed("first", recompute=False, reason="test over")
    decode.kv_failed("big", recompute=False, reason="test over")
    assert decode.num_free_blocks == 12 and not decode.requests


def test_abort_while_waiting_for_kv_sets_blocks_aside_until_settled(prompts):
    decode = connected(num_blocks=64)
    reserve(decode, "gone", prompts[3], GREEDY, len(prompts[3]))
    out = decode.abort("gone")
    assert out.finish_reason == "abort"
    # The transfer into those blocks has not settled: they must not be handed to anyone yet.
    assert decode.num_free_blocks == 64 - 4 and decode.holds.get(set_aside_owner("gone"), Hold.SET_ASIDE)
    decode.kv_ready("gone", 1)          # the transfer lands after all: just free
    assert decode.num_free_blocks == 64 and not decode.holds.count(Hold.SET_ASIDE)
    # A peer that went quiet: give up (recompute elsewhere in the pool), free when it settles.
    reserve(decode, "quiet", prompts[3], GREEDY, len(prompts[3]))
    assert decode.kv_failed("quiet", recompute=True, reason="watchdog", settled=False) is None
    _, done = run_until_finished(decode, "quiet")
    assert done.finish_reason == "length" and decode.num_free_blocks == 64 - 4
    assert decode.release(set_aside_owner("quiet"))
    assert decode.num_free_blocks == 64


def test_a_request_recomputed_while_its_old_blocks_wait_can_retain_its_new_ones(prompts):
    """A bidirectional decode worker gives up on a quiet peer's K/V (blocks set aside), recomputes the
    request and retains its KV at the end, under the request's id: both holds live side by side, and
    settling the transfer frees the set-aside blocks only. (They shared the key: the retain hit an
    assert and the decode worker's engine loop died, in a chaos soak with prefill workers killed.)"""
    decode = connected(num_blocks=64)
    decode.add_request("quiet", prompts[3], GREEDY, remote_tokens=len(prompts[3]), retain=True)
    decode.step()                       # reserves its blocks
    decode.kv_failed("quiet", recompute=True, reason="the prefill worker died", settled=False)
    _, done = run_until_finished(decode, "quiet")
    assert done.finish_reason == "length" and done.retained is not None
    retained = decode.retained("quiet")
    assert retained is not None and decode.holds.get(set_aside_owner("quiet"), Hold.SET_ASIDE)
    decode.kv_ready("quiet", 1)         # the transfer settles late: only the set-aside blocks go back
    assert decode.retained("quiet") is retained and not decode.holds.count(Hold.SET_ASIDE)
    assert decode.num_free_blocks == 64 - len(retained.block_ids)
    assert decode.release("quiet") and decode.num_free_blocks == 64


def post(engine: LLMEngine, **events) -> None:
    """What a connector's threads do: queue outcomes for the engine's next poll, and wake its loop."""
    recorder = engine.connector
    for name, items in events.items():
        getattr(recorder.events, name).extend(items)


def test_abort_of_a_queued_reservation(prompts):
    """A remote-KV request still waiting for blocks is aborted: it ends with 'abort', the loop lives on."""
    engine = connected(num_blocks=16)
    reserve(engine, "hog", prompts[5], GREEDY, len(prompts[5]))         # 7 of 16 blocks
    loop = EngineLoop(engine)
    finished = threading.Event()
    outputs = []

    def on_output(out):
        outputs.append(out)
        finished.set()

    loop.submit("queued", prompts[7], GREEDY, on_output, remote_tokens=len(prompts[7]))
    assert loop.knows("queued") and not loop.knows("nobody")
    loop.start()
    try:
        assert waited_for(lambda: loop.stats()["num_waiting"] == 1)              # 10 blocks needed, 9 free
        assert loop.knows("queued")
        loop.abort("queued")
        assert finished.wait(10) and outputs[-1].finish_reason == "abort"
        assert not loop.knows("queued") and loop.is_alive()
    finally:
        loop.stop()
    engine.kv_failed("hog", recompute=False, reason="test over")
    assert engine.num_free_blocks == 16


@pytest.mark.parametrize("recompute", [True, False])
def test_kv_failure_of_a_queued_reservation(prompts, reference, recompute):
    """The K/V of a remote-KV request that is still queued for blocks will not come (its prefill
    died): it must become a local request (recompute) or end with the reason, not wait for KV forever
    (the fault matrix once saw such a request hang until the router's deadline)."""
    engine = connected(num_blocks=16)
    reserve(engine, "hog", prompts[5], GREEDY, len(prompts[5]))         # 7 of 16 blocks
    loop = EngineLoop(engine)
    on_output = Collected()
    finished, tokens, outputs = on_output.finished, on_output.tokens, on_output.outputs
    loop.submit("queued", prompts[7], GREEDY, on_output, remote_tokens=len(prompts[7]))
    loop.start()
    try:
        assert waited_for(lambda: loop.stats()["num_waiting"] == 1)               # 10 blocks needed, 9 free
        assert "queued" not in engine.connector.reservations
        loop.call(lambda: post(engine, lost=[Lost("queued", recompute, "the prefill worker died"),
                                             Lost("hog", False, "room for the recompute")])).result(10)
        assert finished.wait(30)
        if recompute:
            assert outputs[-1].finish_reason == "length" and tokens == reference[7]
        else:
            assert outputs[-1].finish_reason == "error" and "prefill worker died" in outputs[-1].error
        assert loop.is_alive() and not loop.knows("queued")
    finally:
        loop.stop()
    assert engine.num_free_blocks == 16


def test_a_queued_reservation_gets_blocks_freed_by_the_last_step(prompts):
    """A remote-KV request queued for blocks must get them as soon as a running request finishes,
    even when nothing else happens afterwards: the loop once went to sleep after that last step and
    left the reservation queued until some unrelated message woke it (the fault matrix saw streams
    hang until the router's deadline)."""
    engine = connected(num_blocks=16)
    loop = EngineLoop(engine)
    running, finished = threading.Event(), threading.Event()

    def on_runner(out):
        running.set()
        if out.finished:
            finished.set()

    loop.start()
    try:
        loop.submit("runner", prompts[5], GREEDY, on_runner)         # 7 of 16 blocks while it runs
        assert running.wait(30)
        loop.submit("queued", prompts[7], GREEDY, lambda out: None, remote_tokens=len(prompts[7]))  # needs 10
        assert finished.wait(30)
        deadline = time.monotonic() + 5
        while "queued" not in engine.connector.reservations and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "queued" in engine.connector.reservations, "the reservation still waits although the runner's blocks are free"
        loop.call(lambda: engine.kv_failed("queued", recompute=False, reason="test over")).result(10)
    finally:
        loop.stop()
    assert engine.num_free_blocks == 16



def test_arrived_kv_runs_although_the_waiting_head_does_not_fit(prompts, reference):
    """Requests whose K/V has landed run even when the prompt at the head of the waiting queue
    cannot get its blocks. They used to queue behind it holding their blocks, so with nothing
    running nobody ever freed any: the fault matrix's push/decode-killed case hung to the router's
    deadline on a slow machine (5 arrived requests behind a recomputed prompt, 34 blocks free)."""
    prefill, decode = connected(num_blocks=64), connected(num_blocks=16)
    landed = {}
    for i in (3, 5):                                            # 100 and 200 tokens: 4 + 7 of 16 blocks
        prefill.add_request(f"r{i}", prompts[i], GREEDY, prefill_only=True)
        _, done = run_until_finished(prefill, f"r{i}")
        landed[i] = done, reserve(decode, f"r{i}", prompts[i], GREEDY, done.num_kv_tokens)
    decode.add_request("r7", prompts[7], GREEDY)                # 300 tokens: 10 blocks, 5 are free
    decode.step()
    assert decode.requests["r7"].state is RequestState.WAITING
    tokens = {}
    for i, (done, dest) in landed.items():
        decode.runner.kv_cache[:, dest] = prefill.runner.kv_cache[:, done.kv_block_ids]
        assert prefill.release(f"r{i}")
        tokens[f"r{i}"] = list(decode.kv_ready(f"r{i}", done.new_token_ids[0]).new_token_ids)
    for _ in range(200):
        if not decode.has_work():
            break
        for out in decode.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens == {f"r{i}": reference[i] for i in (3, 5, 7)}
    assert decode.num_free_blocks == decode.num_blocks


def test_a_prompt_chunk_that_preempts_a_decode_already_scheduled(prompts, reference):
    """Decodes are scheduled before prompt chunks and the newest request is preempted first, so a
    chunk that needs a block can preempt a decode whose chunk is already in the step: the step must
    drop that chunk (it once ran it with no blocks: "forward pass failed: list index out of range")."""
    prefill, decode = connected(num_blocks=64), connected(num_blocks=5, max_num_batched_tokens=32)
    decode.add_request("r3", prompts[3], GREEDY)                # 100 tokens in 32-token chunks: 4 blocks
    decode.step()
    prefill.add_request("r1", prompts[1], GREEDY, prefill_only=True)
    _, done = run_until_finished(prefill, "r1")
    dest = reserve(decode, "r1", prompts[1], GREEDY, done.num_kv_tokens)   # 40 tokens: 2 blocks
    decode.runner.kv_cache[:, dest] = prefill.runner.kv_cache[:, done.kv_block_ids]
    tokens = {"r1": list(decode.kv_ready("r1", done.new_token_ids[0]).new_token_ids)}
    for _ in range(300):
        if not decode.has_work():
            break
        for out in decode.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert decode.scheduler.num_preemptions >= 1                 # the case under test happened
    assert tokens == {"r1": reference[1], "r3": reference[3]}
    assert decode.num_free_blocks == decode.num_blocks
def test_a_loop_that_can_run_nothing_sleeps(prompts, reference):
    """A waiting request for which the pool has no room (its blocks are reserved for K/V in flight)
    can only start once a message frees blocks: until then the loop must sleep, not step in a
    circle (it once spun a whole core, which a 2-core host's prefill worker needed)."""
    engine = connected(num_blocks=16)
    reserve(engine, "hog", prompts[5], GREEDY, len(prompts[5]))         # 7 of 16 blocks
    loop = EngineLoop(engine)
    on_output = Collected()
    finished, tokens = on_output.finished, on_output.tokens
    loop.start()
    try:
        loop.submit("big", prompts[7], GREEDY, on_output)                             # needs 10
        assert waited_for(lambda: loop.asleep and "big" in engine.requests)
        steps = loop.num_steps
        time.sleep(0.5)                 # an absence (no step) can only be watched for a while
        assert loop.num_steps == steps and loop.asleep and not finished.is_set(), f"{loop.num_steps - steps} idle steps"
        loop.call(lambda: engine.kv_failed("hog", recompute=False, reason="room for big")).result(10)
        assert finished.wait(30) and tokens == reference[7]
    finally:
        loop.stop()
    assert engine.num_free_blocks == 16


def test_a_connector_event_wakes_a_sleeping_loop(prompts, reference):
    """The connector's threads hand the engine their outcomes through poll(): one that arrives while
    the loop sleeps (nothing runnable) must wake it at once, not wait for an unrelated message."""
    engine = connected(num_blocks=64)
    loop = EngineLoop(engine)
    on_output = Collected()
    done, tokens = on_output.finished, on_output.tokens
    loop.start()
    try:
        loop.submit("lost", prompts[3], GREEDY, on_output, remote_tokens=len(prompts[3]))
        assert waited_for(lambda: "lost" in engine.connector.reservations and loop.asleep)   # reserved, awaiting K/V
        steps = loop.num_steps
        post(engine, lost=[Lost("lost", True, "the transfer failed")])      # from a non-engine thread
        loop.wake()
        assert done.wait(10) and tokens == reference[3] and loop.num_steps > steps
    finally:
        loop.stop()
    assert engine.num_free_blocks == 64
