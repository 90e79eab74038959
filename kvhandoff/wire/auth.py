"""The control token: how workers know an HTTP request comes from their own router (or peer worker).

One secret per deployment (`--kv-secret` or the environment variable KVHANDOFF_SECRET). The token
sent on the wire is an HMAC of a fixed label, never the secret itself, so a leaked token does not
leak the key the transfer agents authenticate with. Requests that carry `kv_transfer_params` or hit
`/kv/*` must present `Authorization: Bearer <control token>` (docs/HANDOFF.md, Authentication).
"""
from __future__ import annotations

import hashlib
import hmac
import os

from kvhandoff.wire.api import APIError

SECRET_ENV = "KVHANDOFF_SECRET"
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
