"""The router's workers: who they are, how loaded and healthy, and which one a request gets."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

import httpx

from kvhandoff.serve.router.errors import describe


def parse_urls(spec: str) -> list[str]:
    """'h:p,http://h2:p2/v1/' -> ['http://h:p', 'http://h2:p2']: workers are named by their base URL."""
    urls = []
    for raw in spec.split(","):
        url = raw.strip().rstrip("/")
        if not url:
            continue
        url = url.removesuffix("/v1")
        urls.append(url if "://" in url else f"http://{url}")
    if not urls:
        raise ValueError(f"no worker URL in {spec!r}")
    return urls


@dataclass
class Worker:
    url: str
    role: str                    # "prefill" or "decode"
    in_flight: int = 0           # requests this router has routed to it and not yet finished
    load: int = 0                # num_running + num_waiting at its last /health
    healthy: bool = True         # until a poll says otherwise
    last_health: dict = field(default_factory=dict)

    def __str__(self) -> str:         # how messages and logs name it
        return f"{self.role} worker {self.url}"


class WorkerPool:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str],
                 on_change: Callable[[Worker], None] = lambda worker: None):
        self.prefills = [Worker(u, "prefill") for u in prefill_urls]
        self.decodes = [Worker(u, "decode") for u in decode_urls]
        self.on_change = on_change
        self.cursor: dict[str, int] = {}              # per role: where the round-robin tie break resumes

    @property
    def workers(self) -> list[Worker]:
        return self.prefills + self.decodes

    def of(self, role: str) -> list[Worker]:
        return self.prefills if role == "prefill" else self.decodes

    def find(self, url: str) -> Worker | None:
        return next((w for w in self.workers if w.url == url), None)

    def pick(self, role: str, excluded: set[str] = frozenset(), prefer: str | None = None) -> Worker:
        """Least loaded: not excluded (it failed this request) first, healthy first, then fewest in
        flight from this router, then the load the worker last reported; ties go round-robin (the
        first tied one after the last pick) so equals share. A healthy `prefer` (the decode worker
        holding the conversation's history) wins outright. The caller holds the worker (one more in
        flight) until it calls release()."""
        workers = self.of(role)
        n, start = len(workers), self.cursor.get(role, 0)
        in_turn = [workers[(start + i) % n] for i in range(n)]
        worker = min(in_turn, key=lambda w: (w.url in excluded, not w.healthy, w.url != prefer, w.in_flight, w.load))
        self.cursor[role] = (workers.index(worker) + 1) % n
        worker.in_flight += 1
        self.on_change(worker)
        return worker

    def release(self, worker: Worker) -> None:
        worker.in_flight -= 1
        self.on_change(worker)

    def has_alternative(self, worker: Worker) -> bool:
        return any(w.healthy and w is not worker for w in self.of(worker.role))

    def least_loaded(self, role: str) -> Worker:
        """For a side call that holds nothing (a prefill worker to hash a prompt)."""
        return min(self.of(role), key=lambda w: (not w.healthy, w.in_flight, w.load))

    def missing_roles(self) -> list[str]:
        return [role for role in ("prefill", "decode") if not any(w.healthy for w in self.of(role))]

    # -- health -----------------------------------------------------------------------------------
    async def check(self, client: httpx.AsyncClient, headers: dict, worker: Worker) -> dict:
        try:
            resp = await client.get(worker.url + "/health", headers=headers, timeout=2.0)
            data = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
            worker.healthy = resp.status_code == 200
            worker.last_health = data if isinstance(data, dict) else {}
            worker.load = int(worker.last_health.get("num_running", 0)) + int(worker.last_health.get("num_waiting", 0))
            status = {"status": "ok" if worker.healthy else "error", **worker.last_health}
        except (httpx.HTTPError, ValueError, TypeError) as e:   # TypeError: counts that are not numbers
            worker.healthy = False
            status = {"status": "unreachable", "error": describe(e)}
        return {**status, "url": worker.url, "role": worker.role, "in_flight": worker.in_flight}

    async def check_all(self, client: httpx.AsyncClient, headers: dict) -> list[dict]:
        return await asyncio.gather(*(self.check(client, headers, w) for w in self.workers))

    async def poll(self, client: httpx.AsyncClient, headers: dict, interval: float) -> None:
        while True:
            await self.check_all(client, headers)
            await asyncio.sleep(interval)
