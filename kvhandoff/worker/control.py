"""Authenticated HTTP from this worker to another: a push decode worker's /kv/info (once per prefill
worker), a bidirectional prefill's /kv/retained/lease. Bodies are the typed messages (wire/messages.py)."""
from __future__ import annotations

import httpx

from kvhandoff.wire import messages as M
from kvhandoff.wire.auth import control_headers
from kvhandoff.wire.http import describe

# What a request to another worker can raise when that worker dies under it. Besides httpx's own
# errors, its transport leaks others: a socket that a SIGKILLed peer closed while httpcore was still
# connecting gave an AttributeError from anyio ('NoneType' object has no attribute 'getpeername'),
# which reached the client as a 500 (a CI run, a prefill worker killed mid-flood). A dead peer is a
# connection failure, whatever the library calls it.
TRANSPORT_FAILURES = (httpx.HTTPError, OSError, AttributeError, RuntimeError)


JSON_HEADERS = {"content-type": "application/json"}


class HTTPControl:
    """The handoff's requests to other workers (/kv/info, /kv/retained/lease). Every
    failure to get an answer is a ConnectionError naming the worker."""

    def __init__(self, secret: bytes):
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), headers=control_headers(secret))

    async def get(self, url: str, path: str) -> dict:
        try:
            data = (await self.http.get(url + path)).raise_for_status().json()
        except (*TRANSPORT_FAILURES, ValueError) as exc:
            raise ConnectionError(f"worker {url} unreachable: {describe(exc)}") from None
        if not isinstance(data, dict):
            raise ConnectionError(f"worker {url} answered {path} with something that is not a JSON object")
        return data

    async def post(self, url: str, path: str, body: M.Message) -> tuple[int, object]:
        try:
            r = await self.http.post(url + path, content=M.encode(body), headers=JSON_HEADERS)
        except TRANSPORT_FAILURES as exc:
            raise ConnectionError(describe(exc)) from None
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text[:200]
