"""A worker process (`kvhandoff serve`): the OpenAI endpoints over one engine (server.py), and on a
prefill or decode worker the handoff (handoff.py) with its runtime (runtime.py: the agent, the
threads, one table of handoffs in flight with a single claim) and one file per protocol side: pull,
push, layerwise, reuse (retention and fetching); what it holds published as KV events (kv_events.py);
faults for tests."""
