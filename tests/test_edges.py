"""Limits a user meets at the edges (issue 26): a request exactly at the context limit is served, one
token over it or one needing more KV blocks than the pool holds is a 400 saying what to change, through
a colocated server and through a disaggregated stack alike; a KV pool that does not fit its
shared-memory directory stops a worker at start-up with a message naming the flags and the mount."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import httpx
import pytest

from conftest import ServerProcess
from test_router import SECRET, Proc, UP_READY

# A 256-token context over a pool of 6 blocks of 32 (192 tokens): both limits are reachable with small
# prompts, and the pool one binds first for long requests.
LIMITS = ("--model", "tiny", "--dtype", "float32", "--max-model-len", "256", "--block-size", "32")


@pytest.fixture(scope="module", params=["colocated", "push"])
def endpoint(request, tmp_path_factory):
    """(base URL, mode) of a colocated server, or of `kvhandoff up --mode push`, with a 256-token context
    and a pool of 16 blocks (512 tokens: the context binds)."""
    log_dir = tmp_path_factory.mktemp(f"limits-{request.param}")
    if request.param == "colocated":
        server = ServerProcess([*LIMITS, "--num-blocks", "16"], log_dir / "server.log")
        yield server.url, request.param
        server.stop()
    else:
        stack = Proc(["up", "--mode", "push", "--port", "0", *LIMITS, "--num-blocks", "16", "--threads", "1"],
                     log_dir / "up.log", UP_READY, timeout=180, env={"KVHANDOFF_SECRET": SECRET})
        yield stack.url, request.param
        assert stack.stop() == 0


def complete(url: str, prompt_len: int, max_tokens: int | None, stream: bool = False) -> httpx.Response:
    body = {"prompt": [7 + n % 300 for n in range(prompt_len)], "temperature": 0, "ignore_eos": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=120)
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        r.read()
    return r


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_exactly_at_the_context_limit_is_served(endpoint, stream):
    url, _ = endpoint
    r = complete(url, 250, 6, stream)
    assert r.status_code == 200, r.text
    if stream:
        assert "data: [DONE]" in r.text and '"error"' not in r.text, r.text[-2000:]
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        usage = chunks[-1]["usage"]
    else:
        usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (250, 6, 256), usage
    r = complete(url, 255, 1)          # the longest prompt there is room for
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


def test_one_token_over_the_context_limit_is_a_400_that_says_what_to_change(endpoint):
    url, mode = endpoint
    r = complete(url, 250, 7)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "at most 6" in error["message"], (mode, error)
    r = complete(url, 256, None)       # no room left even for one generated token
    assert r.status_code == 400 and "shorten the prompt" in r.json()["error"]["message"], r.text


def test_a_request_needing_more_kv_blocks_than_the_pool_is_a_400(tmp_path):
    """6 blocks of 32 tokens: 150 tokens + 50 need 7 of them. The server says so and keeps serving."""
    server = ServerProcess([*LIMITS, "--num-blocks", "6"], tmp_path / "server.log")
    try:
        r = complete(server.url, 150, 50)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "needs 7 KV blocks" in message and "has 6" in message and "max_tokens" in message, message
        r = complete(server.url, 150, 42)      # 192 tokens: exactly the pool
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 42, r.text
        health = server.health()
        assert health["num_free_blocks"] == health["num_blocks"] == 6, health
    finally:
        server.stop()


def test_a_pool_larger_than_its_shared_memory_stops_the_worker_with_what_to_change():
    """A 16 MiB tmpfs as --kv-shm-dir and a 128 MiB pool (2,048 fp32 blocks of 64 KiB): the worker exits at start-up naming the flags and
    the mount to change, with no traceback and no segment left behind."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    directory = tempfile.mkdtemp(prefix="kvh-small-shm-")
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", directory], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
        try:
            r = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "serve", "--role", "prefill", "--port", "0",
                                *LIMITS, "--num-blocks", "2048", "--kv-shm-dir", directory], capture_output=True,
                               text=True, timeout=120, env={**os.environ, "KVHANDOFF_SECRET": SECRET})
            assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert f"128 MiB of shared memory in {directory}, which has 16 MiB free" in r.stderr \
                and "--kv-cache-mb" in r.stderr \
                and "--shm-size" in r.stderr and "--kv-shm-dir" in r.stderr, r.stderr[-3000:]
            assert os.listdir(directory) == []
        finally:
            subprocess.run(["umount", directory], check=True)
    finally:
        os.rmdir(directory)


def test_an_odd_block_size_in_bf16_stops_the_server_with_the_flag_to_change():
    """bf16 blocks hold tokens in pairs (model/paired_kv.py): an odd --block-size is refused at start,
    by a colocated server and by a disaggregated worker alike, naming the flag, without a traceback."""
    flags = ("--model", "tiny", "--dtype", "bfloat16", "--max-model-len", "256", "--block-size", "5", "--port", "0")
    for role in ("both", "decode"):
        r = subprocess.run([sys.executable, "-m", "kvhandoff.cli", "serve", "--role", role, *flags], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "KVHANDOFF_SECRET": SECRET})
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "--block-size" in r.stderr and "must be even, not 5" in r.stderr, r.stderr[-3000:]
