"""The control token: how workers know an HTTP request comes from their own router (or peer worker).

One secret per deployment (`--kv-secret` or the environment variable KVHANDOFF_SECRET). The token
sent on the wire is an HMAC of a fixed label, never the secret itself, so a leaked token does not
leak the key the transfer agents authenticate with. Requests that carry `kv_transfer_params` or hit
`/kv/*` must present `Authorization: Bearer <control token>` (docs/HANDOFF.md, Authentication).

Clients are a separate matter: with an API key (`--api-key` or $KVHANDOFF_API_KEY), a router or a
server lets a request through only with `Authorization: Bearer <API key>` (or the control token: the
router's own calls to its workers, `kvhandoff up`'s health polls), `ClientKeyGate` below.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os

from kvhandoff.wire.api import APIError, error_body

SECRET_ENV = "KVHANDOFF_SECRET"
API_KEY_ENV = "KVHANDOFF_API_KEY"
# Open without the API key unless told otherwise: load balancers and Prometheus rarely carry one.
OPEN_PATHS = "/health,/metrics"
CONTROL_LABEL = b"kvhandoff-control-v1"


def resolve_secret(cli_value: str | None = None) -> bytes | None:
    """The deployment secret: the command-line value if given, else $KVHANDOFF_SECRET, else None."""
    value = cli_value if cli_value else os.environ.get(SECRET_ENV)
    return value.encode() if value else None


def control_token(secret: str | bytes) -> str:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, CONTROL_LABEL, hashlib.sha256).hexdigest()


def control_headers(secret: str | bytes) -> dict[str, str]:
    return {"Authorization": f"Bearer {control_token(secret)}"}


def check_control(request, secret: str | bytes | None) -> None:
    """Raise a 401 APIError unless `request` (anything with `.headers`) carries this deployment's
    control token. A worker without a secret accepts no control request at all."""
    if not secret:
        raise APIError(401, f"this worker has no control secret (start it with --kv-secret or {SECRET_ENV}); "
                       "handoff requests are refused", type="authentication_error", code="unauthorized")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken must not tell an attacker how many leading characters matched.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), control_token(secret)):
        raise APIError(401, "kv_transfer_params and /kv/* are reserved for the router and workers of this "
                       "deployment (missing or wrong control token)", type="authentication_error",
                       code="unauthorized")


def resolve_api_key(cli_value: str | None = None) -> str | None:
    """The clients' API key: the command-line value if given, else $KVHANDOFF_API_KEY, else None."""
    return cli_value or os.environ.get(API_KEY_ENV) or None


def parse_open_paths(spec: str) -> frozenset[str]:
    """'/health,/metrics' -> the paths served without the API key; '' -> none."""
    paths = frozenset(p.strip() for p in spec.split(",") if p.strip())
    bad = [p for p in paths if not p.startswith("/")]
    if bad:
        raise ValueError(f"not a path: {bad[0]!r} (e.g. /health,/metrics, or '' to require the key everywhere)")
    return paths


class ClientKeyGate:
    """ASGI middleware: an HTTP request to any path but `open_paths` needs `Authorization: Bearer` with
    the API key or, where the server has a deployment secret, its control token; else a 401 in the
    OpenAI error shape (what vLLM's `--api-key` answers). Raw ASGI rather than a Starlette
    BaseHTTPMiddleware: that one re-wraps every streamed body, on the first token's path."""

    def __init__(self, app, api_key: str, secret: bytes | None, open_paths: frozenset[str]):
        assert api_key
        self.app, self.open_paths = app, open_paths
        self.accepted = [api_key.encode()] + ([control_token(secret).encode()] if secret else [])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or self.allowed(scope["headers"]):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body("a valid API key is needed: send 'Authorization: Bearer <key>'",
                                     "authentication_error", code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        token = token.strip()
        # compare_digest against each (no early exit on the first byte that differs).
        return scheme.lower() == b"bearer" and any([hmac.compare_digest(token, key) for key in self.accepted])
