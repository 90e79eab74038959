"""The router (a package, one concern a module): the worker pool and its picking (pool.py), one
attempt of a request with its legs, merge and end (attempt.py), the SSE relay (relay.py), retries
(retry.py), the session map of bidirectional reuse (sessions.py), and the app that ties them (app.py).
The order of the legs is each protocol's own: handoff/pull.py and handoff/push.py, `route`."""
from kvhandoff.serve.router.app import Router, RouterConfig, build_router_app
from kvhandoff.serve.router.attempt import Attempt, Phase
from kvhandoff.serve.router.pool import Worker, WorkerPool, parse_urls

__all__ = ["Attempt", "Phase", "Router", "RouterConfig", "Worker", "WorkerPool", "build_router_app", "parse_urls"]
