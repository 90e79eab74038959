"""Bidirectional multi-turn reuse (issue 5): decode keeps a conversation's KV, the next turn's prefill
reads it back. Engine and policy pieces first, then whole stacks (`kvhandoff up --bidirectional`) whose
multi-turn greedy outputs must equal a fresh colocated server's for every full prompt."""
from __future__ import annotations

import os
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import ServerProcess
from test_engine import Recorder
from test_engine import run_until_finished as finish
from test_fleet import indexed
from test_router import start_up, wait_until

from kvhandoff.config import EngineConfig
from kvhandoff.engine.block_pool import hash_chain
from kvhandoff.engine.engine import LLMEngine
from kvhandoff.engine.holds import Hold
from kvhandoff.engine.request import SamplingParams
from kvhandoff.router.sessions import SessionEntry, SessionMap
from kvhandoff.wire.cost import CostModel, PrefillCost, decide, fit_prefill_cost
from kvhandoff.wire.cost import ReuseConfig
from kvhandoff.wire.messages import ReuseCandidate

ROUTER_STARTED = re.compile(r"^kvhandoff up: started (?P<name>router-\d+) \(pid (?P<pid>\d+), (?P<url>http://[^,)]+)",
                            re.M)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(**overrides) -> LLMEngine:
    engine = LLMEngine(EngineConfig(**{"model": "tiny", "dtype": "float32", "threads": 1, "num_blocks": 64,
                                       **overrides}))
    engine.connect(Recorder())
    return engine


# ---------------------------------------------------------------------------------------------------
# Engine: retention, eviction, local prefix on reservation, a fetched prefix

def test_retained_kv_is_kept_reused_and_evicted_under_pressure():
    engine = make_engine(num_blocks=16)
    evicted = []
    engine.on_evict = evicted.append
    prompt = list(range(3, 103))                                  # 100 tokens: 4 blocks with the answer
    engine.add_request("turn1", prompt, GREEDY, retain=True)
    answer, out = finish(engine, "turn1")
    entry = out.retained
    assert entry.token_ids == prompt + answer[:-1]                # the last token's K/V was never computed
    assert len(entry.block_ids) == 4 and engine.num_free_blocks == 12
    # The next turn, arriving from a prefill worker: the retained blocks need not travel again.
    nxt = entry.token_ids + [answer[-1]] + list(range(200, 240))
    engine.add_request("turn2", nxt, GREEDY, remote_tokens=len(nxt))
    engine.step()
    blocks = engine.connector.reservations["turn2"]
    assert engine.requests["turn2"].num_cached_tokens == 96 and blocks[:3] == entry.block_ids[:3]
    engine.kv_failed("turn2", recompute=False, reason="test over")
    # A reader in progress keeps an entry; pressure evicts the unread ones, least recently used first.
    engine.add_request("other", list(range(300, 390)), GREEDY, retain=True)
    _, other = finish(engine, "other")
    entry.readers = 1
    engine.add_request("big", list(range(280, 280 + 32 * 9)), SamplingParams(max_tokens=1, ignore_eos=True))
    finish(engine, "big")
    assert evicted == ["other"] and engine.retained("turn1") is entry
    entry.readers = 0
    assert engine.release("turn1") and not engine.release("turn1")
    assert engine.num_free_blocks == engine.num_blocks and not engine.holds.count(Hold.RETAINED)


def test_fetched_prefix_gives_the_same_tokens():
    """KV of a prompt's prefix copied into the blocks another engine reserved for it (a request whose
    first 128 tokens are remote): only the suffix is computed and the output equals computing
    everything."""
    source, target, reference = make_engine(), make_engine(), make_engine(enable_prefix_caching=False)
    history = list(range(5, 141))                                 # 136 tokens
    source.add_request("h", history, GREEDY, retain=True)
    _, out = finish(source, "h")
    prompt = out.retained.token_ids + list(range(400, 430))
    expected = reference.generate([prompt], GREEDY)[0]
    target.add_request("r", prompt, GREEDY, remote_tokens=128)
    target.step()
    blocks = target.connector.reservations["r"]
    target.runner.kv_cache[:, blocks] = source.runner.kv_cache[:, out.retained.block_ids[:4]]
    assert target.kv_ready("r") is None                          # no first token: the rest is computed here
    assert target.requests["r"].num_computed_tokens == 128
    tokens, done = finish(target, "r")
    assert tokens == expected and done.num_cached_tokens == 128
    assert target.num_free_blocks == target.num_blocks and not target.holds.count(Hold.PINNED)


# ---------------------------------------------------------------------------------------------------
# Policy: the cost model and the session map

def candidate(tokens: list[int], expires_in_s: float = 400.0) -> ReuseCandidate:
    return ReuseCandidate(decode_url="http://d", retention_id="r", block_hashes=[h.hex() for h in hash_chain(tokens, 32)],
                          expires_in_s=expires_in_s)


def test_reuse_decisions():
    history = list(range(1000, 1400))                          # 12 full blocks
    prompt = history + list(range(50, 90))
    hashes = hash_chain(prompt, 32)
    slow_prefill = CostModel(bandwidth_bps=1e9, fetch_overhead_s=0.001, prefill=PrefillCost(ms_per_ktok=10_000))
    fast_prefill = CostModel(bandwidth_bps=1e6, fetch_overhead_s=0.05, prefill=PrefillCost(ms_per_ktok=1.0))
    cfg = ReuseConfig()
    args = (len(prompt), hashes, candidate(history), 32, 720 * 1024)
    d, n = decide(cfg, slow_prefill, *args, locally_cached_blocks=0)
    assert (d.decision, n) == ("fetch", 12) and d.est_fetch_ms < d.est_recompute_ms
    d, n = decide(cfg, fast_prefill, *args, locally_cached_blocks=0)
    assert (d.decision, n) == ("recompute", 0) and "beats fetching" in d.reason
    d, n = decide(ReuseConfig(policy="always"), fast_prefill, *args, locally_cached_blocks=0)
    assert (d.decision, n) == ("fetch", 12)
    d, _ = decide(cfg, slow_prefill, *args, locally_cached_blocks=12)
    assert d.decision == "cache" and "prefix cache" in d.reason
    d, _ = decide(ReuseConfig(min_tokens=500), slow_prefill, *args, locally_cached_blocks=0)
    assert d.decision == "recompute" and "floor" in d.reason
    # The floor is on what would move: 11 of the 12 blocks cached here leave 32 tokens to fetch.
    d, n = decide(cfg, slow_prefill, *args, locally_cached_blocks=11)
    assert (d.decision, n) == ("recompute", 0) and "the 32 that would move are below the floor of 64" in d.reason
    d, n = decide(cfg, slow_prefill, *args, locally_cached_blocks=10)
    assert (d.decision, n) == ("fetch", 12) and d.local_tokens == 320
    d, _ = decide(cfg, slow_prefill, len(prompt), hashes, candidate(history, expires_in_s=1.0), 32, 720 * 1024, 0)
    assert d.decision == "recompute" and "expires" in d.reason
    edited = history[:100] + [7] + history[101:] + list(range(50, 90))       # changed inside block 3
    d, n = decide(cfg, slow_prefill, len(edited), hash_chain(edited, 32), candidate(history), 32, 720 * 1024, 0)
    assert (d.decision, n) == ("fetch", 3) and "differs after token 96" in d.reason
    other = list(range(2000, 2400))
    d, n = decide(cfg, slow_prefill, len(other), hash_chain(other, 32), candidate(history), 32, 720 * 1024, 0)
    assert (d.decision, n) == ("none", 0) and "edited" in d.reason


def test_recompute_cost_grows_with_the_context_it_attends_to():
    """The same 128 missing tokens: recomputed after a short cached prefix, fetched after a long one
    (each of them then attends to the long prefix: the per-context term of the prefill cost)."""
    model = CostModel(bandwidth_bps=1e9, fetch_overhead_s=0.02,
                      prefill=PrefillCost(fixed_ms=30, ms_per_ktok=100, ms_per_ktok_kctx=100))
    cfg = ReuseConfig()

    def decide_after(cached_blocks: int):
        history = list(range(1000, 1000 + 32 * (cached_blocks + 4)))
        prompt = history + list(range(50, 90))
        return decide(cfg, model, len(prompt), hash_chain(prompt, 32), candidate(history), 32, 1024, cached_blocks)

    short, n_short = decide_after(2)
    long, n_long = decide_after(120)
    assert (short.decision, n_short) == ("recompute", 0) and short.est_recompute_ms < short.est_fetch_ms
    assert (long.decision, n_long) == ("fetch", 124) and long.est_recompute_ms > long.est_fetch_ms
    # No fixed cost in a recompute estimate: the prefill runs for the new input anyway.
    assert short.est_recompute_ms == pytest.approx(128 / 1e3 * 100 + 128 * (64 + 64) / 1e6 * 100, rel=1e-3)
    # What the router rebuilds from a worker's /health is the same model; missing fields are the defaults.
    reported = CostModel.from_rates(model.rates())
    assert reported.prefill == model.prefill and reported.fetch_s(4096) == pytest.approx(model.fetch_s(4096))
    assert CostModel.from_rates({}).prefill == PrefillCost() and CostModel.from_rates({}).fetch_s(0) == 0.02


def test_prefill_cost_fit_recovers_its_terms():
    truth = PrefillCost(fixed_ms=40, ms_per_ktok=900, ms_per_ktok_kctx=650)
    rng = random.Random(3)
    observed = []
    for _ in range(48):
        tokens, context = rng.randint(16, 600), rng.choice([0, 0, 300, 900, 1800])
        observed.append((tokens, context, truth.ms(tokens, context) * rng.uniform(0.95, 1.05)))
    fitted = fit_prefill_cost(observed, PrefillCost())
    assert fitted.ms_per_ktok == pytest.approx(900, rel=0.15) and fitted.ms_per_ktok_kctx == pytest.approx(650, rel=0.2)
    assert fitted.ms(328, 1792) == pytest.approx(truth.ms(328, 1792), rel=0.05)
    # Few alike observations stay near the prior instead of extrapolating a wild context term; no
    # coefficient is ever negative.
    one = fit_prefill_cost([(300, 0, 330.0)], PrefillCost())
    assert one.ms(300) == pytest.approx(330, rel=0.1) and min(one.fixed_ms, one.ms_per_ktok, one.ms_per_ktok_kctx) >= 0
    falling = fit_prefill_cost([(100, 0, 200.0), (400, 0, 150.0)], PrefillCost())
    assert min(falling.fixed_ms, falling.ms_per_ktok, falling.ms_per_ktok_kctx) >= 0


def test_session_map_finds_the_longest_match_and_forgets_expired():
    sessions = SessionMap()
    far = time.monotonic() + 100
    sessions.record(SessionEntry("a", "http://d1", "r1", 64, ["h1", "h2"], far))
    sessions.record(SessionEntry("b", "http://d2", "r2", 96, ["h1", "h2", "h3"], far))
    sessions.record(SessionEntry("c", "http://d2", "r3", 96, ["x1"], time.monotonic() - 1))
    assert sessions.match(["h1", "h2", "h3", "h4"]).key == "b"
    assert sessions.match(["h1", "h9"]).key in ("a", "b")
    assert sessions.match(["zz"]) is None and sessions.get("c") is None
    assert sessions.drop("b").retention_id == "r2" and sessions.match(["h1", "h2", "h3"]).key == "a"
    assert sessions.sweep() == [] and len(sessions) == 1


# ---------------------------------------------------------------------------------------------------
# End to end: conversations through the router

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()
ENGINE = ("--dtype", "float32", "--threads", "1", "--num-blocks", "512")
# (and a prefill pool of another size than the decode workers': block ids travel with their pool's
# size, kv_layout.py, both ways here)
NO_PREFILL_CACHE = ("--prefill-args=--no-prefix-caching --num-blocks 448",)


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * 5 + seed * 3 + i // 7) % len(WORDS)] for i in range(n))


def complete(url: str, prompt: str, session: str | None = None, max_tokens: int = 16) -> dict:
    headers = {"X-Session-Id": session} if session else {}
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """The reference: a fresh colocated server's answer to every full prompt (no prefix cache)."""
    server = ServerProcess([*ENGINE[:4], "--model", "tiny", "--no-prefix-caching"],
                           tmp_path_factory.mktemp("colocated") / "serve.log")
    yield server
    server.stop()


def conversation(url: str | list[str], reference: str, turns: int, seed: int, session: str | None) -> list[dict]:
    """`turns` turns, each prompt = the previous prompt + its answer + ~40 new words; every answer is
    checked against the reference; returns the handoff objects. Several URLs: turns go to each in turn."""
    prompt, reports = words(120, seed), []
    urls = [url] if isinstance(url, str) else url
    for turn in range(turns):
        got = complete(urls[turn % len(urls)], prompt, session)
        expected = complete(reference, prompt)["choices"][0]["text"]
        assert got["choices"][0]["text"] == expected, f"turn {turn + 1} differs from colocated"
        reports.append(got["handoff"])
        prompt = prompt + got["choices"][0]["text"] + " " + words(40, seed + turn + 1)
    return reports


def decode_health(url: str) -> dict:
    workers = httpx.get(url + "/health", timeout=10).json()["workers"]
    return next(w for w in workers if w["role"] == "decode")


@pytest.mark.parametrize("mode", ["pull", "pull-reader", "push", "push-layerwise"])
def test_four_turns_reuse_the_history(mode, colocated, tmp_path):
    # Prefill-side prefix caching off, as in the published experiment: otherwise the prefill worker
    # still holds most of the history itself and (rightly) fetches nothing.
    up = start_up(tmp_path, mode, *ENGINE, *NO_PREFILL_CACHE, "--bidirectional", "--reuse-policy", "always")
    try:
        for session in ("chat-1", None):        # named by the client, and found by prompt hashes
            reports = conversation(up.url, colocated.url, 4, seed=len(mode) + (session is None), session=session)
            assert reports[0]["reuse_decision"]["decision"] == "none"
            for turn, report in enumerate(reports[1:], start=2):
                assert report["reuse_decision"]["decision"] == "fetch", (turn, report["reuse_decision"])
                assert report["reused_tokens"] >= 128 and report["reverse_bytes"] > 0, report
                # The turn's decode worker still held the history: only the new blocks travelled.
                assert report["decode_cached_tokens"] >= 128, report
                assert report["retained"]["num_tokens"] > 0
        # Edited history: the match stops where the text changed (or never starts).
        first = words(120, 40)
        answer = complete(up.url, first, "edited")["choices"][0]["text"]
        edited = "zulu " + first[5:] + answer + " " + words(30, 41)
        got = complete(up.url, edited, "edited")
        assert got["choices"][0]["text"] == complete(colocated.url, edited)["choices"][0]["text"]
        assert got["handoff"]["reuse_decision"]["decision"] == "none", got["handoff"]["reuse_decision"]
        # Below the floor (64 tokens): a short history is recomputed.
        short = words(10, 50)                   # ~40 tokens: one full block
        answer = complete(up.url, short, "short")["choices"][0]["text"]
        report = complete(up.url, short + answer + " " + words(30, 51), "short")["handoff"]
        assert report["reuse_decision"]["decision"] == "recompute" and "floor" in report["reuse_decision"]["reason"]
        metrics = httpx.get(decode_health(up.url)["url"] + "/metrics", timeout=10).text
        assert "kvhandoff_retained_sessions" in metrics and 'kvhandoff_retention_events_total{event="reuse_hits"}' in metrics
    finally:
        assert up.stop() == 0, up.text()[-3000:]


def test_two_routers_find_every_conversation_whichever_served_its_last_turn(colocated, tmp_path):
    """`kvhandoff up --routers 2 --bidirectional`: turns alternate between the two routers (each on
    its own port), named and anonymous, and every later turn reads its history back from the decode
    worker the other router left it on. SIGKILL one router: the shared front port keeps serving (and
    reusing) through the other, and `up` restarts the dead one, which finds the conversations too."""
    up = start_up(tmp_path, "push", *ENGINE, *NO_PREFILL_CACHE, "--decode", "2", "--routers", "2",
                  "--bidirectional", "--reuse-policy", "always")
    routers = {m["name"]: (int(m["pid"]), m["url"]) for m in ROUTER_STARTED.finditer(up.text())}
    try:
        assert set(routers) == {"router-0", "router-1"} and up.url not in {u for _, u in routers.values()}
        urls = [routers["router-0"][1], routers["router-1"][1]]
        for url in urls:            # (until then, a router asks the workers whose events it does not follow yet)
            indexed(url)
        for session, seed in (("two-routers", 60), (None, 61)):
            reports = conversation(urls, colocated.url, 4, seed=seed, session=session)
            for turn, report in enumerate(reports[1:], start=2):
                assert report["reuse_decision"]["decision"] == "fetch" and report["reused_tokens"] >= 128, \
                    (session, turn, report["reuse_decision"])
        # Each router learned where the other's turns were kept from the decode workers' KV events:
        # neither asked a worker on a turn's path (/kv/retained/find, /kv/prompt).
        workers = [w["url"] for w in httpx.get(urls[0] + "/health", timeout=10).json()["workers"]]
        asked = [httpx.get(url + "/health", timeout=10).json()["asked"] for url in workers]
        assert all(n == 0 for a in asked for n in a.values()), asked
        os.kill(routers["router-0"][0], signal.SIGKILL)
        # The front: whichever router the kernel hands the connection to; router-1 alone while router-0 is down.
        reports = conversation([up.url], colocated.url, 2, seed=62, session="front")
        assert reports[1]["reuse_decision"]["decision"] == "fetch", reports[1]["reuse_decision"]
        wait_until(lambda: re.search(r"up: router-0 \(pid \d+, [^)]*\) is serving again", up.text()),
                   "router-0 was not restarted", timeout=60)
        restarted = conversation([routers["router-1"][1], routers["router-0"][1]], colocated.url, 2, seed=63,
                                 session="after-restart")
        assert restarted[1]["reuse_decision"]["decision"] == "fetch", restarted[1]["reuse_decision"]
    finally:
        assert up.stop() == 0, up.text()[-3000:]


def test_expired_and_evicted_history_is_recomputed(colocated, tmp_path):
    """A short TTL: after it the decode pool is back at baseline and the next turn recomputes
    correctly. A memory cap smaller than one conversation: the KV is evicted at once and the next
    turn's fetch finds it gone, recomputes, and still answers right."""
    up = start_up(tmp_path, "pull", *ENGINE, *NO_PREFILL_CACHE, "--bidirectional", "--reuse-policy", "always",
                  "--retention-ttl", "2")
    try:
        prompt = words(150, 60)
        answer = complete(up.url, prompt, "ttl")["choices"][0]["text"]
        assert decode_health(up.url)["num_retained"] == 1
        # gone within a second of the TTL (the same bound as a 3 s sleep, without waiting it out)
        wait_until(lambda: decode_health(up.url)["num_retained"] == 0, "retained past its TTL", timeout=3)
        h = decode_health(up.url)
        assert h["num_retained"] == 0 and h["num_free_blocks"] == h["num_blocks"], h
        nxt = prompt + answer + " " + words(30, 61)
        got = complete(up.url, nxt, "ttl")
        assert got["choices"][0]["text"] == complete(colocated.url, nxt)["choices"][0]["text"]
        assert got["handoff"]["reuse_decision"]["decision"] == "none"      # the router forgot it too
    finally:
        assert up.stop() == 0, up.text()[-3000:]
    # A cap smaller than one turn: the decode worker lets the turn go as it keeps it. The router hears
    # it from the worker's KV events and does not offer it; a worker without events (or one whose
    # events lag) is not heard, and the next turn's fetch finds the KV gone and recomputes.
    for events, seed in ((True, 70), (False, 72)):
        up = start_up(tmp_path, "push", *ENGINE, *NO_PREFILL_CACHE, "--bidirectional", "--reuse-policy", "always",
                      "--retention-max-bytes", "1000", *([] if events else ["--decode-args=--no-kv-events"]))
        try:
            prompt = words(150, seed)
            answer = complete(up.url, prompt, "cap")["choices"][0]["text"]
            h = decode_health(up.url)
            assert h["num_retained"] == 0 and h["num_free_blocks"] == h["num_blocks"], h
            nxt = prompt + answer + " " + words(30, seed + 1)
            if events:              # (the eviction's event is on its way: give it the moment it takes)
                wait_until(lambda: httpx.get(up.url + "/health", timeout=10).json()["kv_index"]["retained_turns"] == 0,
                           "the router still offers the evicted turn")
            got = complete(up.url, nxt, "cap")
            assert got["choices"][0]["text"] == complete(colocated.url, nxt)["choices"][0]["text"]
            decision = got["handoff"]["reuse_decision"]
            metrics = httpx.get(h["url"] + "/metrics", timeout=10).text
            assert 'kvhandoff_retention_events_total{event="evictions"} 2.0' in metrics
            if events:
                assert decision["decision"] == "none", decision
                misses = re.search(r'kvhandoff_retention_events_total\{event="lease_misses"\} (\S+)', metrics)
                assert misses is None or float(misses[1]) == 0, misses[0]     # nothing was asked for it
            else:
                assert decision["decision"] == "recompute" and "no such retained KV" in decision["reason"], decision
                assert 'kvhandoff_retention_events_total{event="lease_misses"} 1.0' in metrics  # the fetch found it gone
        finally:
            assert up.stop() == 0, up.text()[-3000:]


def test_a_token_exact_client_reuses_the_whole_history(colocated, tmp_path):
    """An agent that builds each turn's prompt as the previous prompt's ids + the answer's ids (both
    as `return_token_ids` gave them) + its new ids: no re-tokenizing, so every later turn reuses all
    of the history the decode worker retained (prompt and answer but the answer's last token, which
    was never computed), in whole blocks; every answer equals colocated's for the same ids."""
    up = start_up(tmp_path, "push", *ENGINE, *NO_PREFILL_CACHE, "--bidirectional", "--reuse-policy", "always")
    block = httpx.get(decode_health(up.url)["url"] + "/health", timeout=10).json()["block_size"]
    try:
        ids = [(i * 7 + 3) % 500 + 10 for i in range(150)]
        for turn in range(4):
            body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            got = httpx.post(up.url + "/v1/completions", json=body, headers={"X-Session-Id": "agent"}, timeout=120)
            assert got.status_code == 200, got.text
            choice, report = got.json()["choices"][0], got.json()["handoff"]
            expected = httpx.post(colocated.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
            assert choice["token_ids"] == expected["token_ids"] and choice["text"] == expected["text"], turn
            assert choice["prompt_token_ids"] == ids
            if turn:
                assert report["reuse_decision"]["decision"] == "fetch", report["reuse_decision"]
                assert report["reused_tokens"] == (history - 1) // block * block, (report["reused_tokens"], history)
            history = len(ids) + len(choice["token_ids"])
            ids = ids + choice["token_ids"] + [(turn * 13 + i * 5) % 400 + 20 for i in range(40)]
    finally:
        assert up.stop() == 0, up.text()[-3000:]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_changed_histories_reuse_exactly_the_longest_common_prefix(colocated, tmp_path):
    """Clients change what they resend: an earlier turn edited, a reasoning trace stripped from an
    answer, another system prompt, a conversation replayed from an earlier turn. Each time the next
    turn reuses the longest common prefix of the retained tokens and its prompt, in whole blocks, no
    more (and nothing below the 64-token floor); its answer equals colocated's (fp32: recomputing)."""
    up = start_up(tmp_path, "pull", *ENGINE, *NO_PREFILL_CACHE, "--bidirectional", "--reuse-policy", "always")
    block = httpx.get(decode_health(up.url)["url"] + "/health", timeout=10).json()["block_size"]

    def chat(messages: list[dict], session: str) -> tuple[dict, dict]:
        body = {"messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(up.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=120)
        assert r.status_code == 200, r.text
        expected = httpx.post(colocated.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert r.json()["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        return r.json(), r.json()["handoff"]

    def retained(answer: dict) -> list[int]:          # what the decode worker kept of that turn
        return answer["prompt_token_ids"] + answer["choices"][0]["token_ids"][:-1]

    system, user1, user2 = (words(40, 90), words(60, 91), words(30, 92))
    try:
        for case in ("edited", "stripped", "system", "replayed", "extended"):
            s = [{"role": "system", "content": system}, {"role": "user", "content": user1}]
            first, _ = chat(s, case)
            a1 = first["choices"][0]["message"]["content"]
            kept = retained(first)
            history = s + [{"role": "assistant", "content": a1}]
            if case == "edited":            # a word in the middle of the first user turn
                history[1]["content"] = user1.replace(user1.split()[30], "zulu", 1)
            elif case == "stripped":        # the answer's first half dropped, as reasoning traces are
                history[2]["content"] = a1[len(a1) // 2:]
            elif case == "system":
                history[0]["content"] = "zulu " + system
            elif case == "replayed":        # a second turn, then back to the first and another branch
                second, _ = chat(history + [{"role": "user", "content": user2}], case)
                kept = retained(second)
            answer, report = chat(history + [{"role": "user", "content": words(30, 93)}], case)
            lcp = common_prefix(kept, answer["prompt_token_ids"])
            expected = lcp // block * block
            if expected >= 64:
                assert report["reuse_decision"]["decision"] == "fetch", (case, report["reuse_decision"])
                assert report["reused_tokens"] == expected, (case, report["reused_tokens"], lcp)
            else:
                assert report["reuse_decision"]["decision"] != "fetch" and not report.get("reused_tokens"), \
                    (case, lcp, report["reuse_decision"])
            # Nothing changed: all of the prompt at least; the answer only as far as its text, re-tokenized
            # inside the template, gives back the generated ids (return_token_ids avoids that; see above).
            assert case != "extended" or lcp >= len(first["prompt_token_ids"]), (lcp, len(kept))
    finally:
        assert up.stop() == 0, up.text()[-3000:]


def test_a_prefill_worker_that_caches_part_of_the_history_fetches_only_the_rest(colocated, tmp_path):
    """Prefill-side prefix caching on (the deployment's real baseline): the next turn's prefill worker
    still holds the previous prompt's blocks, so it READs only the blocks after them (the previous
    answer's) from the decode worker, and its cost model weighs exactly those blocks. (Answers of 72
    tokens: at least the floor's 64 tokens past the previous prompt's blocks.)"""
    up = start_up(tmp_path, "push", *ENGINE, "--bidirectional", "--reuse-policy", "always")
    health = httpx.get(decode_health(up.url)["url"] + "/health", timeout=10).json()
    block, block_bytes = health["block_size"], health["block_bytes"]
    try:
        ids = [(i * 7 + 3) % 500 + 10 for i in range(200)]
        for turn in range(3):
            body = {"prompt": ids, "max_tokens": 72, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            got = httpx.post(up.url + "/v1/completions", json=body, headers={"X-Session-Id": "cached"}, timeout=120)
            choice, report = got.json()["choices"][0], got.json()["handoff"]
            expected = httpx.post(colocated.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
            assert choice["token_ids"] == expected["token_ids"], turn
            if turn:
                decision = report["reuse_decision"]
                reusable = (history - 1) // block * block
                local = previous // block * block      # the previous prompt, cached by this prefill worker
                assert decision["decision"] == "fetch" and decision["reusable_tokens"] == reusable, decision
                assert decision["local_tokens"] == local and 0 < local < reusable, decision
                assert report["reused_tokens"] == reusable - local, report
                assert report["reverse_bytes"] == (reusable - local) // block * block_bytes, report
            # what the prefill worker's own cache served: the previous prompt's whole blocks (none at first)
            assert report.get("prefill_cached_tokens", 0) == (local if turn else 0), report     # 0 is left out
            previous, history = len(ids), len(ids) + len(choice["token_ids"])
            ids = ids + choice["token_ids"] + [(turn * 13 + i * 5) % 400 + 20 for i in range(40)]
    finally:
        assert up.stop() == 0, up.text()[-3000:]


def test_the_router_chooses_cache_fetch_or_recompute_per_turn(colocated, tmp_path):
    """Two prefill workers (cache-aware, 150 ms more a step), prefix caching on: a conversation's next
    turn goes to the prefill worker that caches its history while that one is idle; while it computes
    a long prompt, to the other, which fetches the history from the decode worker; a history under
    the floor is recomputed. Each choice, with every candidate's inputs, is in `route_decision`."""
    up = start_up(tmp_path, "push", *ENGINE, "--prefill", "2", "--bidirectional", "--prefill-policy", "cache-aware",
                  "--health-interval", "0.2", "--prefill-args=--inject-faults step_ms=150")

    def turn(ids: list[int], session: str) -> dict:
        body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(up.url + "/v1/completions", json=body, headers={"X-Session-Id": session}, timeout=120)
        assert r.status_code == 200, r.text
        expected = httpx.post(colocated.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert r.json()["choices"][0]["token_ids"] == expected["token_ids"]
        return r.json()

    def busy_at(url: str) -> bool:
        """The router has the long prompt on `url`, and its last poll of `url` reported it queued (so
        the choice does not hang on this router's own count alone)."""
        workers = httpx.get(up.url + "/health", timeout=10).json()["workers"]
        w = next(w for w in workers if w["url"] == url)
        return w["in_flight"] > 0 and (w.get("num_tokens_to_prefill") or 0) > 0

    try:
        a = [(i * 7 + 3) % 500 + 10 for i in range(200)]
        first = turn(a, "conv")
        holder = first["handoff"]["prefill_worker"]
        nxt = a + first["choices"][0]["token_ids"] + [(i * 5) % 400 + 20 for i in range(40)]
        second = turn(nxt, "conv")
        idle = second["handoff"]
        route = idle["route_decision"]
        assert route["choice"] == "cache" and route["prefill_worker"] == holder == idle["prefill_worker"], route
        assert len(route["candidates"]) == 2 and all(
            {"cached_tokens", "fetchable_tokens", "queued_tokens", "est_compute_ms", "est_ms"} <= set(c)
            for c in route["candidates"]), route
        # Keep the holder busy with a long prompt that shares its cached prefix, then the next turn.
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(turn, a + [(i * 3) % 450 + 30 for i in range(2800)], "busy")
            deadline = time.monotonic() + 30
            while not busy_at(holder) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert busy_at(holder), "the long prompt never reached the holder"
            nxt = nxt + second["choices"][0]["token_ids"] + [(i * 9) % 400 + 20 for i in range(40)]
            seen = [{k: w.get(k) for k in ("url", "in_flight", "num_tokens_to_prefill", "reuse_rates")}
                    for w in httpx.get(up.url + "/health", timeout=10).json()["workers"] if w["role"] == "prefill"]
            got = turn(nxt, "conv")["handoff"]
            busy.result()
        route = got["route_decision"]
        assert route["choice"] == "fetch" and route["prefill_worker"] != holder, (route, seen)
        assert route["measured_ms"] > 0, route
        assert got["reuse_decision"]["decision"] == "fetch" and got["reused_tokens"] > 0, got["reuse_decision"]
        # Under the floor: 40 tokens of history and 16 of answer are one block.
        short = [(i * 11) % 300 + 40 for i in range(40)]
        answer = turn(short, "short")["choices"][0]["token_ids"]
        route = turn(short + answer + [50] * 30, "short")["handoff"]["route_decision"]
        assert route["choice"] == "recompute", route
    finally:
        assert up.stop() == 0, up.text()[-3000:]



def metric(text: str, name: str) -> float:
    """A sample's value in Prometheus' text format (0 when it has none yet)."""
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def test_retention_metrics_are_what_the_decode_worker_holds(colocated, tmp_path):
    """Sampled between the turns of three conversations and after their TTL: the Prometheus series
    equal the blocks the decode worker holds, a read back counts as a hit with its bytes, a
    superseded turn and the expiries are counted by cause."""
    ttl = 6         # outlives the four requests and five samples before the last sample(3) (~1 s here)
    up = start_up(tmp_path, "pull", *ENGINE, *NO_PREFILL_CACHE, "--bidirectional", "--reuse-policy", "always",
                  "--retention-ttl", str(ttl))
    decode = decode_health(up.url)["url"]

    def sample(sessions: int) -> tuple[dict, str]:
        health, text = httpx.get(decode + "/health", timeout=10).json(), httpx.get(decode + "/metrics", timeout=10).text
        assert health["num_retained"] == sessions and metric(text, "kvhandoff_retained_sessions") == sessions, health
        assert metric(text, "kvhandoff_retained_bytes") == health["num_retained_blocks"] * health["block_bytes"]
        return health, text

    try:
        prompt = words(120, 80)
        prompt += complete(up.url, prompt, "m0")["choices"][0]["text"] + " " + words(30, 90)
        sample(1)
        report = complete(up.url, prompt, "m0")["handoff"]         # read back; this turn replaces the first
        assert report["reuse_decision"]["decision"] == "fetch", report["reuse_decision"]
        health, text = sample(1)
        assert metric(text, 'kvhandoff_retention_events_total{event="reuse_hits"}') == 1
        assert metric(text, 'kvhandoff_retention_events_total{event="superseded"}') == 1
        assert metric(text, "kvhandoff_retention_leased_bytes_total") == \
            report["reused_tokens"] // health["block_size"] * health["block_bytes"]
        for conv in (1, 2):
            complete(up.url, words(120, 80 + conv), f"m{conv}")
            sample(conv + 1)
        # all expired and their blocks free within a second of the TTL (the bound an 11 s sleep on a 10 s TTL set)
        wait_until(lambda: (lambda h: h["num_retained"] == 0 and h["num_free_blocks"] == h["num_blocks"])(
            httpx.get(decode + "/health", timeout=10).json()), "retained KV outlived its TTL", timeout=ttl + 1)
        health, text = sample(0)
        assert health["num_free_blocks"] == health["num_blocks"], health
        assert metric(text, 'kvhandoff_retention_events_total{event="expiries"}') == 3
    finally:
        assert up.stop() == 0, up.text()[-3000:]
