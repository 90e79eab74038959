"""Data plane: registered memory, one-sided READ/WRITE and notifications between agents (NIXL-shaped).

Knows nothing of models: it moves bytes between registered regions. See agent.py for the API.
"""
from kvhandoff.transfer.agent import RegionInfo, TransferAgent
from kvhandoff.transfer.descriptors import DescList
from kvhandoff.transfer.errors import AuthenticationError, OutOfBoundsError, PeerError, TransferError, TransferTimeout
from kvhandoff.transfer.handle import Handle, Op, XferState

__all__ = ["TransferAgent", "RegionInfo", "DescList", "Handle", "Op", "XferState", "TransferError",
           "AuthenticationError", "OutOfBoundsError", "PeerError", "TransferTimeout"]
