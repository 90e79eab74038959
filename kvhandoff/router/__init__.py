"""The router, its own process and package (one concern a module): the worker pool and its picking
(pool.py, policies.py, prefix.py), what every worker holds from its KV events (kv_feed.py
subscribes, kv_index.py indexes) and the prompt as the workers tokenize it (prompts.py), one attempt
of a request: its state and end (attempt.py) and what it says to each engine's workers (native.py:
ours; vllm.py: vLLM's), the router's leg of each protocol (legs.py, shared by both engines), the SSE
relay with migration (relay.py), retries (retry.py), the session map of bidirectional reuse
(sessions.py; vllm_sessions.py for vLLM's), the client to its workers (upstream.py: over each one's
persistent channel, channel.py, or HTTP; answer.py is what comes back either way), the admin
endpoints (admin.py) and the app that ties them (app.py). It imports kvhandoff.wire and, to tokenize
and hash prompts bit for bit as the workers do, two torch-free modules of theirs (model/tokenizer.py,
engine/block_pool.py): never the worker stack, the engine loop or torch (tests/test_router.py checks)."""
from kvhandoff.router.app import Router, RouterConfig, build_router_app
from kvhandoff.router.attempt import Attempt, Phase
from kvhandoff.router.native import NativeAttempt
from kvhandoff.router.pool import Worker, WorkerPool, parse_urls

__all__ = ["Attempt", "NativeAttempt", "Phase", "Router", "RouterConfig", "Worker", "WorkerPool", "build_router_app", "parse_urls"]
