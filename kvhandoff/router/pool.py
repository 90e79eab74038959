"""The router's workers: who they are, how loaded and healthy, which one a request gets, and how the
set changes at run time (add, and remove by draining: a removed worker gets no new request and leaves
the pool when its last one has finished)."""
from __future__ import annotations

import asyncio
import heapq
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from kvhandoff.router.answer import UpstreamError
from kvhandoff.router.errors import describe
from kvhandoff.router.policies import DecodePolicy, PrefillPolicy, ranking
from kvhandoff.router.prefix import PrefixIndex, PromptFacts
from kvhandoff.router.upstream import Upstream
from kvhandoff.wire.modes import ROLES, Role

log = logging.getLogger("kvhandoff.router")
# A pick weighs every worker of a pool up to PICK_ALL workers; of a larger one a random PICK_SAMPLE,
# the PICK_SAMPLE holding the longest part of the prompt and the preferred one: WorkerPool.candidates.
PICK_ALL, PICK_SAMPLE = 8, 4


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
    role: Role
    in_flight: int = 0           # requests this router has routed to it and not yet finished
    load: int = 0                # num_running + num_waiting at its last /health
    healthy: bool = True         # until a poll says otherwise
    draining: bool = False       # removed at run time: no new requests; gone once in_flight is 0
    routed_since_poll: int = 0   # requests this router sent it since its last /health answer
    tokens_in_flight: int = 0    # prompt tokens of this router's requests it holds (when known)
    last_health: dict = field(default_factory=dict)
    polled_at: float = 0.0       # monotonic time its last_health came
    instance: str | None = None  # the run of a worker that added itself (`serve --join`); a restart is another
    unreachable_since: float | None = None    # monotonic time of the first failed poll in a row
    rates_seen: tuple[dict, object] | None = None   # (the /health it was read from, its CostModel): policies.py

    @property
    def joined(self) -> bool:
        """It added itself: forgotten once unreachable for long (forget_vanished)."""
        return self.instance is not None

    def __str__(self) -> str:         # how messages and logs name it
        return f"{self.role} worker {self.url}"


class WorkerPool:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str],
                 on_change: Callable[[Worker], None] = lambda worker: None,
                 decode_policy: DecodePolicy = DecodePolicy.FEWEST, prefill_policy: PrefillPolicy = PrefillPolicy.FEWEST,
                 forget_joined_after_s: float = 30.0,
                 on_polled: Callable[[Worker, bool], None] = lambda worker, reachable: None):
        self.forget_joined_after_s = forget_joined_after_s
        self.on_polled = on_polled                    # after each /health poll (reachable?), and on leaving (False)
        self.drained_instances: set[str] = set()      # joined workers drained by an admin: they stay out
        self.prefills = [Worker(u, Role.PREFILL) for u in prefill_urls]
        self.decodes = [Worker(u, Role.DECODE) for u in decode_urls]
        self.by_url: dict[str, Worker] = {w.url: w for w in self.prefills + self.decodes}
        self.on_change = on_change
        self.policies = {Role.PREFILL: prefill_policy, Role.DECODE: decode_policy}
        self.prefix = PrefixIndex()                   # what each prefill worker should have cached
        self.cursor: dict[Role, int] = {}              # per role: where the round-robin tie break resumes
        self._polled = asyncio.Event()                # set (and replaced) after each poll of every worker

    @property
    def workers(self) -> list[Worker]:
        return self.prefills + self.decodes

    def of(self, role: Role) -> list[Worker]:
        return self.prefills if role == Role.PREFILL else self.decodes

    def serving(self, role: Role) -> list[Worker]:
        """The role's workers that may get new requests (not draining)."""
        return [w for w in self.of(role) if not w.draining]

    def find(self, url: str) -> Worker | None:
        return self.by_url.get(url)

    def candidates(self, role: Role, facts: PromptFacts | None = None, prefer: str | None = None) -> list[Worker]:
        """The workers a pick weighs: all of the role's, up to PICK_ALL of them; in a larger pool a
        random PICK_SAMPLE ("power of d choices": nearly as balanced as weighing all, at a cost that
        does not grow with the pool) plus the PICK_SAMPLE that hold the longest part of the prompt
        (facts.cached) and the preferred one, so that what makes a worker best is not left out."""
        workers = self.serving(role)
        if len(workers) <= PICK_ALL:
            return workers
        chosen = {id(w): w for w in random.sample(workers, PICK_SAMPLE)}
        deepest = heapq.nlargest(PICK_SAMPLE, facts.cached, key=facts.cached.__getitem__) if facts is not None else []
        for url in [*deepest, prefer]:
            worker = self.by_url.get(url) if url else None
            if worker is not None and worker.role == role and not worker.draining:
                chosen.setdefault(id(worker), worker)
        return list(chosen.values())

    def pick(self, role: Role, excluded: set[str] = frozenset(), prefer: str | None = None,
             facts: PromptFacts | None = None, cost=None, among: list[Worker] | None = None) -> Worker:
        """Not excluded (it failed this request) first, healthy first, a healthy `prefer` (the
        decode worker holding the conversation's history) outright, then the role's policy
        (policies.py); ties go round-robin (the first tied one after the last pick) so equals
        share. Draining workers are never picked. The caller holds the worker (one more in flight)
        until it calls release(). `facts`: the prompt's, when known (cache-aware prefill); `cost`:
        the caller's ranking instead of the policy's (a conversation's three-way choice), over `among`
        (its candidates(); by default the pool's). Round-robin weighs every worker."""
        workers = self.serving(role) if among is None or self.policies[role] is DecodePolicy.ROUND_ROBIN else among
        if len(workers) > PICK_ALL and not any(w.url not in excluded and w.healthy for w in workers):
            workers = self.serving(role)        # a sample of failed or unhealthy ones: weigh everyone
        assert workers, f"no {role} worker left in the pool"      # remove() keeps one of each role
        n, start = len(workers), self.cursor.get(role, 0) % len(workers)
        in_turn = [workers[(start + i) % n] for i in range(n)]
        cost = cost or ranking(self.policies[role], workers, facts, self.prefix)
        worker = min(in_turn, key=lambda w: (w.url in excluded, not w.healthy, w.url != prefer, cost(w)))
        self.cursor[role] = (workers.index(worker) + 1) % n
        self.hold(worker, facts)
        return worker

    def hold(self, worker: Worker, facts: PromptFacts | None = None) -> None:
        """One more request of this router on `worker` (until release)."""
        worker.in_flight += 1
        worker.routed_since_poll += 1
        if facts is not None:
            worker.tokens_in_flight += facts.num_tokens
            if worker.role == Role.PREFILL:
                if worker.url not in facts.indexed:         # (its events tell what it holds)
                    self.prefix.record(worker.url, facts.block_hashes, worker.last_health.get("num_blocks"))
        self.on_change(worker)

    def release(self, worker: Worker, facts: PromptFacts | None = None) -> None:
        worker.in_flight -= 1
        worker.tokens_in_flight -= facts.num_tokens if facts is not None else 0
        reported = worker.last_health.get("num_tokens_to_prefill")
        if facts is not None and isinstance(reported, int) and reported > 0:
            # A prompt that is done is queued nowhere: a report taken while it was still being computed
            # would otherwise make an idle worker look busy until the next poll.
            worker.last_health["num_tokens_to_prefill"] = max(0, reported - facts.num_tokens)
        self.on_change(worker)
        if worker.draining and worker.in_flight == 0:
            self._drop(worker)

    def has_alternative(self, worker: Worker) -> bool:
        return any(w.healthy and w is not worker for w in self.serving(worker.role))

    def least_loaded(self, role: Role) -> Worker:
        """For a side call that holds nothing (a prefill worker to hash a prompt)."""
        return min(self.serving(role), key=lambda w: (not w.healthy, w.in_flight, w.load))

    def missing_roles(self) -> list[Role]:
        return [role for role in ROLES if not any(w.healthy for w in self.serving(role))]

    # -- the set of workers, changed at run time (the router's /admin/workers) -----------------------
    def add(self, role: Role, url: str, instance: str | None = None) -> Worker:
        """A new worker, in rotation at once (healthy until a poll says otherwise, as at start). Adding
        a worker that is draining takes it back; adding one that is there is a no-op. `instance`: the
        worker added itself (joined), as this run of it; it is forgotten once unreachable for
        forget_joined_after_s (a worker named by the operator stays, unhealthy, until a poll finds it
        back), and once drained (remove) that run of it is refused: its next "I am here" must not undo
        the drain."""
        assert role in ROLES, role
        if instance is not None and instance in self.drained_instances:
            raise ValueError(f"{url} was drained from the pool: this run of it does not join again (a restarted "
                             "worker does)")
        worker = self.find(url)
        if worker is not None:
            if worker.role != role:
                raise ValueError(f"{url} is already in the pool as a {worker.role} worker")
            if instance is None or not worker.draining:     # (a joined one's own "I am here" undoes no drain)
                worker.draining = False
            if worker.joined and instance is not None:
                worker.instance = instance      # restarted on its URL before this pool forgot it
            return worker
        worker = Worker(url, role, instance=instance)
        self.of(role).append(worker)
        self.by_url[url] = worker
        self.on_change(worker)
        return worker

    def remove(self, url: str, for_good: bool = True) -> Worker:
        """Drain `url`: no new requests from now on; it leaves the pool when its last one finishes.
        The last worker of a role cannot be removed (add its replacement first). `for_good`: a joined
        worker's run is not taken back when it says again that it is there."""
        worker = self.find(url)
        if worker is None:
            raise KeyError(url)
        if not any(w is not worker for w in self.serving(worker.role)):
            raise ValueError(f"{worker} is the last {worker.role} worker in the pool; add another one first")
        if for_good and worker.instance is not None:
            self.drained_instances.add(worker.instance)
        worker.draining = True
        if worker.in_flight == 0:
            self._drop(worker)
        return worker

    def _drop(self, worker: Worker) -> None:
        self.prefix.forget(worker.url)
        workers = self.of(worker.role)
        if worker in workers:
            workers.remove(worker)
        if self.by_url.get(worker.url) is worker:
            del self.by_url[worker.url]
        self.on_polled(worker, False)       # (out of the pool first: that is how it tells leaving from a failed poll)

    # -- health -----------------------------------------------------------------------------------
    async def check(self, upstream: Upstream, worker: Worker) -> dict:
        try:
            status, data = await upstream.call("GET", worker.url + "/health", timeout=2.0)
            worker.healthy, worker.unreachable_since = status == 200, None
            worker.last_health = data if isinstance(data, dict) else {}
            worker.polled_at = time.monotonic()
            worker.routed_since_poll = 0
            worker.load = int(worker.last_health.get("num_running", 0)) + int(worker.last_health.get("num_waiting", 0))
            status = {"status": "ok" if worker.healthy else "error", **worker.last_health}
            self.on_polled(worker, True)
        except (UpstreamError, ValueError, TypeError) as e:   # TypeError: counts that are not numbers
            worker.healthy = False
            worker.unreachable_since = worker.unreachable_since or time.monotonic()
            self.prefix.forget(worker.url)      # it may have died: whatever it had cached is gone
            self.on_polled(worker, False)
            status = {"status": "unreachable", "error": describe(e)}
        return {**status, "url": worker.url, "role": worker.role, "in_flight": worker.in_flight,
                **({"draining": True} if worker.draining else {})}

    async def check_all(self, upstream: Upstream) -> list[dict]:
        return await asyncio.gather(*(self.check(upstream, w) for w in self.workers))

    def forget_vanished(self, now: float) -> list[Worker]:
        """Drain every joined worker unreachable for forget_joined_after_s (it died without leaving;
        if it comes back it joins again), except the last of its role."""
        gone = []
        for worker in self.workers:
            if worker.joined and not worker.draining and worker.unreachable_since is not None \
                    and now - worker.unreachable_since >= self.forget_joined_after_s:
                try:
                    self.remove(worker.url, for_good=False)
                except ValueError:
                    continue
                log.warning("forgot %s: unreachable for %.0f s (it joined by itself; it may join again)",
                            worker, now - worker.unreachable_since)
                gone.append(worker)
        return gone

    async def poll(self, upstream: Upstream, interval: float) -> None:
        while True:
            await self.check_all(upstream)
            self.forget_vanished(time.monotonic())
            polled, self._polled = self._polled, asyncio.Event()
            polled.set()
            await asyncio.sleep(interval)

    async def next_poll(self) -> None:
        """Returns once every worker has been polled again (never, with polling off)."""
        await self._polled.wait()
