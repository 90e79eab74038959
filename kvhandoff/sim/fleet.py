"""A discrete-event model of a disaggregated fleet: P prefill and D decode workers behind a router,
each phase costing what calibrate.py fitted from a real run. Deterministic under a seed (heapq, one
random.Random). What it models, and what it leaves out:

- arrivals go to the prefill worker with the fewest requests (the router's default), where they queue
  after the fitted admission time (HTTP, admission: paid with nobody ahead too); it computes them
  in steps as the engine does: each step takes up to `token_budget` prompt tokens (the engine's
  --max-num-batched-tokens, 512 by default) from the queue's head, chunking a long prompt, and costs
  the fitted line at those tokens plus a measured residual; a prompt is computed when the step with
  its last chunk ends (a burst of short prompts shares steps instead of queueing one behind another);
- the decode worker is chosen by the run's decode policy (round-robin, fewest-in-flight, load) at
  arrival (push: early binding) or when the prompt is computed (pull: late binding); with late
  binding (push) a request is moved once at a poll that finds its worker fallen behind, before its
  prompt is computed. `load` and late binding read a snapshot taken every poll interval, as the
  router does; the router's own in-flight counts are exact;
- after the prompt: the first token reaches the client after a measured delay (it comes from the
  prefill's answer: protocol 5), while the KV moves (handoff_wait, the median, then the transfer);
  once it has landed, the decode worker's first step makes the second token after a measured delay
  of that worker, and from then on the request is in that worker's batch. The
  transfer is the fitted one (on bytes, as the calibration run moved them: concurrent transfers do
  not slow each other), or behind a `Link` of a given rate: bytes / rate through the prefill worker's
  one link, which its transfers take in turn (the decode side's links are taken as never the
  bottleneck), plus the fitted fixed part. With layer-wise push (`Link.layerwise`, bindings early and
  late-bound) the KV leaves as the layers are computed: the link starts after the first layer and
  the last layer's share follows the prompt's end; pull (late binding) moves it all after the prompt;
- a decode worker steps while it has sequences, each step costing its fitted time at that batch
  size, one token per sequence per step; a worker of a scaled fleet takes the costs of the real
  worker at its index modulo the real count (a slow one stays slow, in the same share);
- the spread the calibration run measured is drawn per request (seeded): its prefill time is the
  fitted one plus a residual measured at a similar size, and so is its transfer over the free link
  (behind an emulated link the link's own queue is the spread), its TPOT the fitted one times a
  measured ratio, its first two tokens' delays measured ones. (A request's drawn TPOT ratio
  stretches its own timeline only: its seat in the batch frees when the fitted steps are done, so
  the batch dynamics stay the fitted ones.)
"""
from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from kvhandoff.sim.calibrate import Costs, Linear

LATE_BINDING_MARGIN = 1.5        # as the router's policies.LATE_BINDING_MARGIN
POLICIES = ("round-robin", "fewest-in-flight", "load")
BINDINGS = ("early", "late", "late-bound")


@dataclass
class Job:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int | None = None  # what its prefill computes (the rest was cached or fetched); None: all
    prefill: int = -1
    decode: int = -1
    moved_from: int | None = None
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    landed: float = 0.0
    ingress: float = 0.0                # arrival -> the prefill worker has it (s)
    egress: float = 0.0                 # a token made -> at the client (s)
    overhead_draw: int = 0              # the calibration request its ingress and first token's egress are from
    first_token: float = 0.0            # at the client
    second_step: float = 0.0            # the decode worker's first step done (its clock)
    end: float = 0.0
    steps_left: int = 0
    tpot_scale: float = 1.0
    to_prefill: int = 0

    def __post_init__(self):
        if self.computed_tokens is None:
            self.computed_tokens = self.prompt_tokens

    def report(self, costs: Costs) -> dict:
        tpot = (self.end - self.first_token) / (self.output_tokens - 1) if self.output_tokens > 1 else None
        return {"index": self.index, "arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "prefill_worker": self.prefill, "decode_worker": self.decode,
                "moved_from": self.moved_from,
                "ttft_ms": 1e3 * (self.first_token - self.arrival_s), "tpot_ms": None if tpot is None else 1e3 * tpot,
                "phases_ms": {"prefill_queue": 1e3 * (self.prefill_start - self.arrival_s - self.ingress),
                              "prefill_compute": 1e3 * (self.prefill_end - self.prefill_start),
                              "handoff_wait": costs.handoff_wait_ms,
                              "transfer": 1e3 * (self.landed - self.prefill_end) - costs.handoff_wait_ms}}


@dataclass
class Decoder:
    step: Linear
    second_token_ms: list[float]     # landed -> its first step done (the second token), as measured
    spread: list[float]              # TPOT / fitted TPOT, as measured
    running: list[Job] = field(default_factory=list)
    joining: list[Job] = field(default_factory=list)
    stepping: bool = False
    in_flight: int = 0               # the router's count: bound here, not finished
    snapshot: tuple[float, int] = (0.0, 0)     # (step ms, sequences) at the last poll
    routed_since_poll: int = 0


@dataclass(frozen=True)
class RouterCosts:
    """What a router costs, as `python -m kvhandoff.bench.router --workers N` measured it (its
    results.json; the row with the most workers): the CPU of one request's decision and relay, the
    block events a request causes (stored and evicted; every router absorbs every worker's) and what
    each costs it, and the CPU it spends per worker and second with no request (health polls,
    heartbeats). A router is one core: it serves its share of the requests in turn, each slower by
    the share of its core the events and polls take."""
    decision_ms: float
    events_per_request: float
    us_per_event: float
    idle_ms_per_worker_s: float
    measured_workers: int

    @classmethod
    def from_bench(cls, rows: list[dict]) -> "RouterCosts":
        indexed = [r for r in rows if r.get("index") and r.get("idle_cpu_ms_per_s") is not None]
        if not indexed:
            raise ValueError("no row of `python -m kvhandoff.bench.router --workers N` (its results.json) in it")
        row = max(indexed, key=lambda r: r["workers"])
        events = row["events_per_s"] / row["requests_per_s"]
        idle = row["idle_cpu_ms_per_s"] / row["workers"]
        # The load's CPU per request holds its decision, its share of the events, and the idle polls.
        decision = (row["cpu_ms_per_request"] - events * row["apply_us_per_event"] / 1e3
                    - row["idle_cpu_ms_per_s"] / row["requests_per_s"])
        return cls(max(decision, 0.0), events, row["apply_us_per_event"], idle, row["workers"])

    def background_share(self, rate: float, workers: int) -> float:
        """Of each router's core: every worker's events at `rate` requests/s, and every worker's polls."""
        return rate * self.events_per_request * self.us_per_event / 1e6 + workers * self.idle_ms_per_worker_s / 1e3

    def max_rate(self, routers: int, workers: int) -> float:
        """Requests/s the routers can decide: (rate / routers) x decision + background <= one core each."""
        spare = 1.0 - workers * self.idle_ms_per_worker_s / 1e3
        return max(0.0, spare) / (self.decision_ms / 1e3 / routers + self.events_per_request * self.us_per_event / 1e6)


@dataclass(frozen=True)
class Routing:
    """The routers in front of a simulated fleet (None in Fleet: a router that costs nothing)."""
    costs: RouterCosts
    routers: int = 1
    rate: float = 0.0                # the arrival rate, for the events' share of each router's core


@dataclass(frozen=True)
class Link:
    """The link between prefill and decode workers; bits_per_s None: the transfer as fitted."""
    bits_per_s: float | None = None
    layerwise: bool = False          # push bindings send each layer as it is computed
    layers: int = 30                 # SmolLM2-135M's: the last layer's share of the KV follows the prompt


class Fleet:
    def __init__(self, costs: Costs, num_prefill: int, num_decode: int, policy: str | None = None,
                 binding: str | None = None, poll_s: float | None = None, seed: int = 0,
                 link: Link = Link(), token_budget: int = 512, routing: Routing | None = None):
        self.costs = costs
        self.routing = routing
        self.router_free = [0.0] * (routing.routers if routing else 0)     # when each router is next idle
        self.token_budget = token_budget
        self.link = link
        self.link_free = [0.0] * num_prefill         # when each prefill worker's link is next idle
        self.policy = policy or costs.decode_policy
        mode_binding = "late" if costs.mode.startswith("pull") else ("late-bound" if costs.late_binding else "early")
        self.binding = binding or mode_binding          # early (push), late (pull), late-bound (push + moves)
        assert self.binding in BINDINGS and self.policy in POLICIES, (self.binding, self.policy)
        self.poll_s = poll_s or costs.poll_s
        self.rng = random.Random(seed)
        real = [(costs.step_ms[url], costs.second_token_ms[url], costs.step_spread.get(url) or [1.0])
                for url in costs.decode_workers]
        self.decoders = [Decoder(*real[i % len(real)]) for i in range(num_decode)]
        self.prefill_queues: list[list[Job]] = [[] for _ in range(num_prefill)]
        self.prefill_busy = [False] * num_prefill
        self.events: list = []
        self.seq = 0
        self.turn = 0
        self.now = 0.0

    # -- the event queue ----------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, args))

    def run(self, jobs: list[Job]) -> list[dict]:
        for job in jobs:
            self.at(job.arrival_s, self.arrive, job)
        self.at(0.0, self.poll)
        self.pending = len(jobs)
        while self.events and self.pending:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        return [job.report(self.costs) for job in jobs]

    # -- the router ----------------------------------------------------------------------------------
    def wait(self, d: Decoder, joining: int = 1) -> float:
        step_ms, seqs = d.snapshot
        return (step_ms or self.typical_step()) * (joining + seqs + d.routed_since_poll)

    def typical_step(self) -> float:
        known = [d.snapshot[0] for d in self.decoders if d.snapshot[0]]
        return statistics.median(known) if known else 1.0

    def pick_decode(self) -> int:
        n = len(self.decoders)
        order = [(self.turn + i) % n for i in range(n)]
        if self.policy == "round-robin":
            key = lambda i: 0
        elif self.policy == "load":
            key = lambda i: self.wait(self.decoders[i])
        else:
            key = lambda i: (self.decoders[i].in_flight, self.decoders[i].snapshot[1])
        chosen = min(order, key=key)
        self.turn = (chosen + 1) % n
        return chosen

    def bind(self, job: Job, index: int) -> None:
        job.decode = index
        self.decoders[index].in_flight += 1
        self.decoders[index].routed_since_poll += 1

    def poll(self) -> None:
        for d in self.decoders:
            batch = len(d.running) + len(d.joining)
            d.snapshot = (d.step(max(1, batch)) if batch else d.snapshot[0] or d.step(1), batch)
            d.routed_since_poll = 0
        if self.binding == "late-bound":
            for queue in self.prefill_queues:
                for job in queue:                    # bound, prompt not computed yet: no WRITE started
                    self.maybe_move(job)
        self.at(self.now + self.poll_s, self.poll)

    def maybe_move(self, job: Job) -> None:
        if job.moved_from is not None or job.decode < 0:
            return
        here = self.decoders[job.decode]
        others = [i for i in range(len(self.decoders)) if i != job.decode]
        if not others:
            return
        best = min(others, key=lambda i: self.wait(self.decoders[i]))
        here_wait, there = self.wait(here, joining=0), self.wait(self.decoders[best])
        if here_wait > LATE_BINDING_MARGIN * there and here_wait - there > self.typical_step():
            here.in_flight -= 1
            job.moved_from = job.decode
            self.bind(job, best)

    # -- prefill -------------------------------------------------------------------------------------
    def arrive(self, job: Job) -> None:
        job.prefill = min(range(len(self.prefill_queues)),
                          key=lambda i: (len(self.prefill_queues[i]) + self.prefill_busy[i], i))
        if self.binding != "late":
            self.bind(job, self.pick_decode())
        # The way in and the first token's way out are drawn from one measured request, together: a stall
        # on the router's core delays one or the other of them, so drawn apart they added two stalls where
        # a request met one (a CI run's replay put TTFT at 18.7 ms against 14.2 measured).
        job.overhead_draw = self.rng.randrange(len(self.costs.first_token_ms))
        job.ingress = self.costs.ingress_ms[job.overhead_draw] / 1e3 if self.costs.ingress_ms else 0.0
        job.ingress += self.router_wait(job)
        self.at(self.now + job.ingress + self.costs.admission_ms / 1e3, self.admitted, job)

    def router_wait(self, job: Job) -> float:
        """Its turn on its router (the kernel spreads connections: in turn) and its decision there, the
        router's core shared with every worker's events and polls (s; 0 without a router model)."""
        if self.routing is None:
            return 0.0
        router = job.index % self.routing.routers
        workers = len(self.prefill_queues) + len(self.decoders)
        spare = max(0.01, 1.0 - self.routing.costs.background_share(self.routing.rate, workers))
        decision = self.routing.costs.decision_ms / 1e3
        start = max(self.now, self.router_free[router])
        self.router_free[router] = start + decision / spare
        # (The calibrated ingress holds one decision of a lightly loaded router already.)
        return max(0.0, self.router_free[router] - self.now - decision)

    def admitted(self, job: Job) -> None:
        job.to_prefill = max(1, job.computed_tokens)
        self.prefill_queues[job.prefill].append(job)
        self.start_prefill(job.prefill)

    def start_prefill(self, p: int) -> None:
        """A step over the head of the queue: up to the token budget, the last prompt maybe in part."""
        if self.prefill_busy[p] or not self.prefill_queues[p]:
            return
        chunks, budget = [], self.token_budget
        for job in self.prefill_queues[p]:
            if budget <= 0:
                break
            if job.to_prefill == max(1, job.computed_tokens):
                job.prefill_start = self.now
            take = min(budget, job.to_prefill)
            chunks.append((job, take))
            budget -= take
        tokens = self.token_budget - budget
        step_ms = self.costs.prefill_ms(tokens) + self.costs.prefill_spread.draw(self.rng, tokens)
        self.prefill_busy[p] = True
        self.at(self.now + max(0.0, step_ms) / 1e3, self.prefill_stepped, p, chunks)

    def prefill_stepped(self, p: int, chunks: list[tuple[Job, int]]) -> None:
        self.prefill_busy[p] = False
        for job, take in chunks:
            job.to_prefill -= take
            if job.to_prefill == 0:
                self.prefill_queues[p].remove(job)
                self.prefilled(job)
        self.start_prefill(p)

    def prefilled(self, job: Job) -> None:
        job.prefill_end = self.now
        job.egress = self.costs.first_token_ms[job.overhead_draw] / 1e3
        job.first_token = self.now + job.egress
        if self.binding == "late":
            self.bind(job, self.pick_decode())
        mib = job.prompt_tokens * self.costs.kv_bytes_per_token / 2**20
        self.at(self.moved(job, mib) + self.costs.handoff_wait_ms / 1e3, self.land, job)

    def moved(self, job: Job, mib: float) -> float:
        """When the job's KV has crossed the link (before the handoff's coordination)."""
        link = self.link
        if link.bits_per_s is None:
            return self.now + max(0.0, self.costs.transfer_ms(mib) + self.costs.transfer_spread.draw(self.rng, mib)) / 1e3
        send_s = mib * 2**20 * 8 / link.bits_per_s
        if link.layerwise and self.binding != "late":
            first_layer = job.prefill_start + (self.now - job.prefill_start) / link.layers
            start = max(first_layer, self.link_free[job.prefill])
            end = max(start + send_s, self.now + send_s / link.layers)
        else:
            end = max(self.now, self.link_free[job.prefill]) + send_s
        self.link_free[job.prefill] = end
        return end + self.costs.transfer_ms.a / 1e3

    # -- decode --------------------------------------------------------------------------------------
    def land(self, job: Job) -> None:
        job.landed = self.now
        d = self.decoders[job.decode]
        job.tpot_scale = self.rng.choice(d.spread)
        if job.output_tokens <= 1:          # the first token was the whole answer
            self.finish(d, job, job.first_token)
            return
        self.at(self.now + self.rng.choice(d.second_token_ms) / 1e3, self.second, job)

    def second(self, job: Job) -> None:
        """The decode worker's first step made the second token; the rest come a step each. Each
        reaches the client the way the first did (worker -> router -> client: the job's egress), never
        before the first (the router holds them until it has sent that)."""
        job.second_step, job.steps_left = self.now, job.output_tokens - 2
        d = self.decoders[job.decode]
        if job.steps_left <= 0:
            self.finish(d, job, max(self.now + job.egress, job.first_token))
            return
        d.joining.append(job)
        if not d.stepping:
            self.step(d)

    def step(self, d: Decoder) -> None:
        d.running += d.joining
        d.joining = []
        if not d.running:
            d.stepping = False
            return
        d.stepping = True
        self.at(self.now + d.step(len(d.running)) / 1e3, self.stepped, d)

    def stepped(self, d: Decoder) -> None:
        for job in list(d.running):
            job.steps_left -= 1
            if job.steps_left == 0:
                d.running.remove(job)
                end = job.second_step + job.egress + job.tpot_scale * (self.now - job.second_step)
                self.finish(d, job, max(end, job.first_token))
        self.step(d)

    def finish(self, d: Decoder, job: Job, end: float) -> None:
        job.end = end
        d.in_flight -= 1
        self.pending -= 1


def poisson_jobs(costs: Costs, rate: float, count: int, seed: int, output_cv: float | None = None) -> list[Job]:
    """`count` arrivals at `rate` per second, lengths drawn from the calibration run's (a request's
    prompt, computed and output lengths together); with `output_cv`, output lengths are drawn instead
    from a lognormal of the run's mean output length and that coefficient of variation (0: all equal;
    2: heavy-tailed, a few answers many times the mean), from a generator of their own: every spread
    gets the same arrivals and prompts."""
    rng, lengths = random.Random(seed), random.Random(f"{seed}-outputs")
    lengths_seen = list(zip(costs.prompt_tokens, costs.computed_tokens or costs.prompt_tokens, costs.output_tokens))
    mean = statistics.fmean(costs.output_tokens)
    sigma = math.sqrt(math.log(1 + output_cv ** 2)) if output_cv else 0.0
    t, jobs = 0.0, []
    for i in range(count):
        prompt, computed, output = rng.choice(lengths_seen)
        if output_cv is not None:
            output = max(2, round(lengths.lognormvariate(math.log(mean) - sigma ** 2 / 2, sigma)))
        jobs.append(Job(i, t, prompt, output, computed))
        t += rng.expovariate(rate)
    return jobs
