"""Each protocol side as a state machine with no I/O (docs/STRUCTURE.md walks them in a request).

A side's state is a frozen msgspec Struct with a phase enum (copied at each step: a frozen
dataclass cost 5x more, ~40 us a handoff); `step(state, event) -> (state, actions)` is the whole
protocol: which events it takes in which state, and what must happen then (notify a peer, post a
WRITE, land or lose a request's K/V, release blocks, end the handoff in the table). The drivers
(worker/pull.py, push.py, layerwise.py, reuse.py, arrivals.py) own the threads and sockets: they
turn what happened into events and carry the actions out. Tests feed events from a table
(tests/test_protocol.py) with no engine, agent or socket.

- pull_prefill.py: a prompt computed and pinned under a lease, until read, expired or cancelled.
- push_prefill.py: a computed prompt and a decode worker's registration meet, in either order; the
  WRITE, late binding, keep-alives.
- layers.py: layer-wise push's plan: which (blocks, layers) each WRITE carries as layers compute.
- arrival.py: the decode side of pull and push, and a prefill's read of retained history (the reuse
  decision itself is wire/cost.py's `decide`, pure too): K/V expected, landed or lost, blocks set
  aside while a transfer may still land in them.
- retention.py: a finished turn's KV kept on a bidirectional decode worker: read back, let go, never
  freed under a reader.
"""
