"""The one error every part of the worker's handoff raises for its HTTP side to answer."""
from __future__ import annotations


class HandoffError(Exception):
    """A handoff that cannot proceed; `status` is the HTTP status the caller should answer with,
    `code` the error code that lets a worker tell one refusal from another."""

    def __init__(self, message: str, status: int = 500, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code
