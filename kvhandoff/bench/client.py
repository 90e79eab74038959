"""What a client sees: one streamed completion timed from the outside, over HTTP only.

TTFT is measured here, not taken from the server (../shared/MEASURING.md): from just before the request
is sent to the arrival of the first chunk that carries generated text. The server's own `timings` and
`handoff` objects (from the last chunk) ride along to explain it. Nothing here imports the engine, so
it measures any OpenAI-compatible endpoint the same way.

The client is aiohttp: its own time is inside every TTFT it reports. Against one colocated tiny
server, alternated request by request (2-core AMD EPYC, 2026-12-03), the client's TTFT exceeded the
server's own by 4.7 and 5.2 ms through httpx and by 3.5 and 4.2 ms through aiohttp: about 1.1 ms of
the client's CPU less per request, which the handoff's phases (measured inside the stack) can never
account for.
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy

from kvhandoff.wire.auth import API_KEY_ENV

# Common English words: random sequences of them tokenise at a stable rate (about one token per word
# with a leading space in any English BPE), so a prompt's length can be aimed at with a word count.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education foot boy age policy music market sense nation plan college "
         "interest death experience effect class control care field development role effort rate heart drug "
         "show leader light voice wife police mind price report decision son view relationship town road arm "
         "difference value building action model season society tax director position player record paper "
         "space ground form event official matter center couple site project activity star table need court "
         "oil situation cost industry figure street image phone data picture practice piece land product "
         "doctor wall patient worker news test movie north love support technology step baby computer type "
         "attention film tree source organization hair window evidence population truth visit fire river "
         "green quiet small large early young important few public bad same able").split()




def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass
class RequestResult:
    """One request as the client saw it. Times are ms from the moment it was sent."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    token_times_ms: list[float] = field(default_factory=list)   # arrival of each chunk that carried text
    text: str = ""
    error: str | None = None          # why it failed (HTTP status and message, or the transport error)
    timings: dict | None = None       # the server's timings object, when it sends one
    handoff: dict | None = None       # the server's handoff object (disaggregated stacks)
    sent_at: float = 0.0              # perf_counter when it was sent (for arrival-time plots)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: (end - first token) / (tokens - 1)."""
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {**asdict(self), "tpot_ms": self.tpot_ms}


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    """Greedy, exactly max_tokens tokens (ignore_eos + min_tokens: every request does the same work),
    streamed with usage so the token counts come from the server."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


def open_session(read_timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """The benchmarks' HTTP client: kept-alive connections, as many as the load needs; a wait for
    the next byte longer than `read_timeout_s` fails the request; $KVHANDOFF_API_KEY, if set, is sent
    as the endpoint's API key. (Call inside the event loop.)"""
    key = os.environ.get(API_KEY_ENV)
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=read_timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0), read_bufsize=2 ** 20,
                                 headers={"Authorization": f"Bearer {key}"} if key else None)


async def get_json(client: aiohttp.ClientSession, url: str, timeout_s: float | None = None):
    """GET `url`'s JSON (aiohttp.ClientError if it answers an error status); within `timeout_s` if
    given, else the session's timeouts."""
    async with client.get(url, **_within(timeout_s)) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


async def get_text(client: aiohttp.ClientSession, url: str, timeout_s: float | None = None) -> str:
    async with client.get(url, **_within(timeout_s)) as resp:
        resp.raise_for_status()
        return await resp.text()


def _within(timeout_s: float | None) -> dict:
    # (aiohttp reads timeout=None as "no timeout at all", not as the session's)
    return {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}


async def stream_completion(client: aiohttp.ClientSession, base_url: str, body: dict,
                            headers: dict | None = None) -> RequestResult:
    """One streamed request; a body with `messages` goes to chat completions, else to completions."""
    result = RequestResult()
    t0 = result.sent_at = time.perf_counter()
    ms = lambda: (time.perf_counter() - t0) * 1e3
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        async with client.post(f"{base_url}{path}", json=body, headers=headers) as resp:
            if resp.status != 200:
                raw = (await resp.read()).decode(errors="replace")
                result.error = f"HTTP {resp.status}: {error_message(raw)}"
                return result
            async for raw in resp.content:          # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = f"stream error: {error_message(payload.decode(errors='replace'))}"
                    break
                read_chunk(result, chunk, ms())
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.e2e_ms = ms()
    if result.error is None and result.ttft_ms is None:
        result.error = "the stream ended without any generated text"
    return result


def read_chunk(result: RequestResult, chunk: dict, now_ms: float) -> None:
    text = "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                   for choice in chunk.get("choices") or ())
    if text:
        result.text += text
        result.token_times_ms.append(now_ms)
        if result.ttft_ms is None:
            result.ttft_ms = now_ms
    if usage := chunk.get("usage"):
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.output_tokens = usage.get("completion_tokens", 0)
    for key in ("timings", "handoff"):
        if isinstance(chunk.get(key), dict):
            setattr(result, key, chunk[key])


def error_message(raw: str) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:300]


def percentile(values: list[float | None], q: float) -> float | None:
    """Linearly interpolated percentile (q in 0..100) of the values that are not None; None if none are."""
    values = [v for v in values if v is not None]
    return float(numpy.percentile(values, q)) if values else None
