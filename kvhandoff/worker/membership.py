"""A worker that finds its routers (`kvhandoff serve --join ROUTER[,ROUTER...]`, issue 27).

Once it serves, the worker adds itself to each router's pool (POST /admin/workers with the deployment's
control token, with an id of this run), and says so again every REFRESH_S: a router that restarted has
forgotten it (adding a worker the pool has is a no-op). At shutdown it drains itself from each
(DELETE /admin/workers). A worker that dies without a word is forgotten by the routers once their
health polls have not reached it for --forget-joined-after-s (router/pool.py), so it leaves either way.
An admin's drain of a joined worker (`kvhandoff workers remove`) sticks: the router refuses this run's
next "I am here" (a restarted worker joins again). Nothing here ever stops the worker: a router that
is down or refuses is logged and tried again.
"""
from __future__ import annotations

import logging
import threading
import uuid
from urllib.parse import urlsplit

import httpx

from kvhandoff.transfer.agent import WILDCARD_HOSTS
from kvhandoff.wire.auth import control_headers
from kvhandoff.wire.modes import ROLES, Role

log = logging.getLogger("kvhandoff.join")
REFRESH_S = 10.0


def advertised_url(host: str, port: int, advertise: str | None) -> str:
    """The URL routers reach this worker at: --advertise-url, else the address it is bound to (which
    must then be an address, not 0.0.0.0 or ::). ValueError saying what to pass otherwise."""
    if advertise is None:
        if host in WILDCARD_HOSTS:
            raise ValueError(f"bound to {host or 'every address'}, which routers cannot reach: pass --advertise-url "
                             "http://ADDRESS:PORT with this machine's address as the routers see it")
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    url = advertise.rstrip("/").removesuffix("/v1")
    parts = urlsplit(url)
    try:
        valid = parts.scheme in ("http", "https") and parts.hostname not in (None, *WILDCARD_HOSTS) \
            and parts.port is not None and not parts.path
    except ValueError:          # a port that is not a number
        valid = False
    if not valid:
        raise ValueError(f"--advertise-url must be http://ADDRESS:PORT, an address routers can reach, not {advertise!r}")
    return url


class Membership:
    """This worker's place in each router's pool, kept by a daemon thread."""

    def __init__(self, routers: list[str], role: Role, url: str, secret: bytes):
        assert role in ROLES, role
        self.routers, self.role, self.url = routers, role, url
        self.headers = control_headers(secret)
        self.instance = uuid.uuid4().hex        # this run: once an admin drains it, it stays out
        self.joined: dict[str, bool | None] = dict.fromkeys(routers, False)    # None: failing now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="kvh-join", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _keep(self) -> None:
        with httpx.Client(timeout=5.0, headers=self.headers) as client:
            while True:
                for router in self.routers:
                    self._join(client, router)
                if self._stop.wait(REFRESH_S):
                    return

    def _join(self, client: httpx.Client, router: str) -> None:
        body = {"role": self.role, "url": self.url, "instance": self.instance}
        try:
            answer = client.post(router + "/admin/workers", json=body)
        except httpx.HTTPError as exc:
            self._lost(router, f"unreachable ({type(exc).__name__}: {exc})")
            return
        if answer.status_code == 200:        # (also when it had us: adding a member again is a no-op)
            if not self.joined[router]:
                log.info("joined %s as a %s worker at %s", router, self.role, self.url)
            self.joined[router] = True
        elif answer.status_code in (401, 403):
            self._lost(router, f"refused our control token ({answer.status_code}): is $KVHANDOFF_SECRET the "
                               "router's?")
        else:
            self._lost(router, f"answered {answer.status_code}: {answer.text[:300]}")

    def _lost(self, router: str, why: str) -> None:
        # Said at every change of state, not at every refresh: a router down for an hour is one line.
        if self.joined[router] is not None:
            log.warning("could not join %s: %s (trying again every %.0f s)", router, why, REFRESH_S)
        self.joined[router] = None

    def leave(self) -> None:
        """Drain this worker from every router (best effort: a router that is down forgets it by itself)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(6.0)
        with httpx.Client(timeout=3.0, headers=self.headers) as client:
            for router in self.routers:
                try:
                    answer = client.delete(router + "/admin/workers", params={"url": self.url})
                except httpx.HTTPError as exc:
                    log.warning("could not leave %s: %s", router, exc)
                    continue
                if answer.status_code == 200:
                    log.info("left %s", router)
                elif answer.status_code != 404:     # (404: it had forgotten us already)
                    log.warning("could not leave %s: %d %s", router, answer.status_code, answer.text[:300])
