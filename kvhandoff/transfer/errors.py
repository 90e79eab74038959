"""What the data plane raises. Every message names the peer and the operation it is about."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer, handshake or peer operation failed."""


class AuthenticationError(TransferError):
    """The handshake failed: one side could not prove it holds the shared secret."""


class PeerError(TransferError):
    """The peer is unknown, disconnected, or cannot serve this kind of transfer."""


class TransferTimeout(TransferError, TimeoutError):
    """wait() ran out of time; the transfer itself may still finish."""


class OutOfBoundsError(TransferError, ValueError):
    """A descriptor names bytes outside a registered region (or a region that is not registered)."""
