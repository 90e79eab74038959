"""A worker process (`kvhandoff serve`), assembled for its role in app.py (docs/STRUCTURE.md).

    app.py            build_worker: engine, loop, server; on a prefill or decode worker the handoff's parts
                      and only its role's sides (Handoff)
    server.py         the OpenAI endpoints over one engine; handoff.py adds the /kv/* routes and the
                      handoff's answers and metrics; control.py: HTTP to other workers
    protocol/         each protocol side as a state machine with no I/O: step(state, event) -> (state, actions)
    pull.py push.py layerwise.py reuse.py arrivals.py
                      the sides, driving those machines: pull and push prefill and decode, layer-wise push,
                      retention and reverse reads (bidirectional), K/V arriving from a peer
    engine_door.py inflight.py mailbox.py peers.py chores.py
                      the parts a side is given: the way to the engine, the table of handoffs in flight,
                      notifications, connected agents, threads and timers
    connector.py      the engine's hooks, to the side that tracks each request
    kv_layout.py      where a block's bytes sit in the pool, and their checksums
    kv_events.py      what the worker holds, published to the routers
    membership.py, faults.py, metrics.py, config.py, errors.py

Imports point down: app -> handoff/server -> sides -> parts -> protocol; protocol imports only wire/.
"""
