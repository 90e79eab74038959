"""Workloads for `kvhandoff bench`: what to send and when, generated from a seed or replayed from a file.

A workload is a list of WorkItems, each an arrival offset and an OpenAI request (a completion prompt or
chat messages, max_tokens, optional session id). Saved as JSON lines, one item per line, so a generated
workload can be replayed exactly, or a recorded one measured:

    {"offset_s": 0.0, "prompt": "...", "max_tokens": 128}
    {"offset_s": 1.7, "messages": [{"role": "user", "content": "..."}], "max_tokens": 64, "session_id": "c1"}

Multi-turn items name the turn they continue (`after`: the index of the previous turn's item): their
prompt is that turn's prompt, its answer and the item's own new text, known only once the answer is
in, and they are sent `think_s` after it (offset_s is ignored for them).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from kvhandoff.bench.client import random_text


@dataclass
class WorkItem:
    offset_s: float = 0.0
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 128
    session_id: str | None = None
    after: int | None = None            # multi-turn: index of the item whose answer this turn continues
    think_s: float = 0.0                # multi-turn: pause after that answer
    target_tokens: int | None = None    # what the generator aimed at (reports group by it)
    tags: dict = field(default_factory=dict)

    def __post_init__(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a work item needs exactly one of prompt and messages")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, not {self.max_tokens!r}")
        if self.offset_s < 0 or self.think_s < 0:
            raise ValueError("offset_s and think_s cannot be negative")

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, {}) and not (k == "think_s" and v == 0)}


def save(items: list[WorkItem], path: Path) -> None:
    with open(path, "w") as f:
        for item in items:
            f.write(json.dumps(item.to_json()) + "\n")


def load(path: Path) -> list[WorkItem]:
    """Read a JSON-lines workload; errors name the line."""
    items = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
                unknown = set(data) - set(WorkItem.__dataclass_fields__)
                if unknown:
                    raise ValueError(f"unknown field(s) {sorted(unknown)}")
                item = WorkItem(**data)
                if item.after is not None and not 0 <= item.after < len(items):
                    raise ValueError(f"after={item.after} does not name an earlier item")
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no work items")
    return items


def poisson_offsets(rng: random.Random, count: int, rate: float) -> list[float]:
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def grid(seed: int, count: int, rate: float, shortest: int, longest: int, words_per_token: float,
         max_tokens: int = 128) -> list[WorkItem]:
    """The push/pull experiment's mix, scaled: prompt lengths log-uniform in [shortest, longest]
    tokens (the original spans 1k-16k, a 16x range), Poisson arrivals at `rate` per second."""
    rng = random.Random(f"grid-{seed}-{rate}")
    items = []
    for offset in poisson_offsets(rng, count, rate):
        tokens = round(math.exp(rng.uniform(math.log(shortest), math.log(longest))))
        items.append(WorkItem(offset, prompt=random_text(rng, max(1, round(tokens * words_per_token))),
                              max_tokens=max_tokens, target_tokens=tokens))
    return items


def binding(seed: int, count: int, rate: float, shortest: int, longest: int, words_per_token: float,
            max_tokens: int = 128, long_share: float = 0.25, burst_share: float = 0.3) -> list[WorkItem]:
    """The binding experiment's load (issue 14): decode load that is uneven and shifts while prompts
    are being computed, the regime where choosing the decode worker early or late can differ.
    - prompts: mostly short (log-uniform over the lower half of [shortest, longest], in log terms), a
      `long_share` of long ones (the upper half): the articles' long/short mix;
    - answers: heavy-tailed (Pareto, shape 1.2, median max_tokens / 2, at least 2, at most 4 x
      max_tokens): a few long generations keep one decode worker busy while others free up;
    - arrivals: Poisson at `rate` on average, but a `burst_share` of them come in bursts of 4 at once.
    Tags: class (short/long) and burst, per request."""
    rng = random.Random(f"binding-{seed}-{rate}")
    mid = math.sqrt(shortest * longest)
    scale = (max_tokens / 2) / 2 ** (1 / 1.2)        # Pareto's median is scale x 2^(1/shape)
    event_rate = rate / (1 + 3 * burst_share)          # arrival events, each 1 or 4 requests: `rate` requests/s
    items, t = [], 0.0
    while len(items) < count:
        size = 4 if rng.random() < burst_share else 1
        for _ in range(min(size, count - len(items))):
            long = rng.random() < long_share
            low, high = (mid, longest) if long else (shortest, mid)
            tokens = round(math.exp(rng.uniform(math.log(low), math.log(high))))
            answer = max(2, min(4 * max_tokens, round(scale * rng.paretovariate(1.2))))
            items.append(WorkItem(t, prompt=random_text(rng, max(1, round(tokens * words_per_token))),
                                  max_tokens=answer, target_tokens=tokens,
                                  tags={"class": "long" if long else "short", "burst": size > 1}))
        t += rng.expovariate(event_rate)
    return items


# Named think-time profiles (seconds from an answer to the next turn), lognormal (median, sigma):
# a person chatting, an agent waiting on its tools, a human reviewing the answer.
THINK_PROFILES = {"chat": (4.0, 0.6), "agent": (20.0, 0.8), "review": (150.0, 0.7)}


def think_times(profile: str) -> Callable[[random.Random], float]:
    """A named profile (THINK_PROFILES) or a file of think times in seconds (one a line, `#` comments),
    drawn uniformly: a sampler; ValueError saying what is wrong."""
    if profile in THINK_PROFILES:
        median, sigma = THINK_PROFILES[profile]
        return lambda rng: rng.lognormvariate(math.log(median), sigma)
    path = Path(profile)
    if not path.is_file():
        raise ValueError(f"think profile {profile!r} is neither {', '.join(THINK_PROFILES)} nor a file")
    values = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            values.append(float(line))
        except ValueError:
            raise ValueError(f"{path}:{n}: {line!r} is not a number of seconds") from None
        if values[-1] < 0:
            raise ValueError(f"{path}:{n}: a think time cannot be negative")
    if not values:
        raise ValueError(f"{path}: no think times in it")
    return lambda rng: rng.choice(values)


def multiturn(seed: int, conversations: int, turns: int, new_tokens: int, answer_tokens: int, think_s: float,
              words_per_token: float, stagger_s: float = 2.0, resumed_after_s: float = 0.0,
              think: Callable[[random.Random], float] | None = None) -> list[WorkItem]:
    """Conversations as chat messages: each turn adds ~new_tokens of user text to the history and
    waits think_s (jittered, sometimes longer: a tool-like pause) after the previous answer, or what
    `think` draws (a profile: think_times). With resumed_after_s, the last turn of every other
    conversation comes back after that long idle."""
    rng = random.Random(f"multiturn-{seed}")
    items: list[WorkItem] = []
    for conv in range(conversations):
        previous = None
        for turn in range(1, turns + 1):
            text = random_text(rng, max(1, round(new_tokens * words_per_token)))
            pause = think(rng) if think else think_s * rng.uniform(0.5, 1.5) * (4 if rng.random() < 0.15 else 1)
            if resumed_after_s and turn == turns and conv % 2 == 1:
                pause = resumed_after_s
            item = WorkItem(conv * stagger_s, messages=[{"role": "user", "content": text}],
                            max_tokens=answer_tokens, session_id=f"conv-{seed}-{conv}", after=previous,
                            think_s=0.0 if previous is None else round(pause, 3),
                            tags={"conversation": conv, "turn": turn})
            previous = len(items)
            items.append(item)
    return items
