"""Status codes carried in finish_reason and admin replies (docs/design.md), and the
error that carries one."""
from __future__ import annotations

BAD_REQUEST, NOT_FOUND, CONFLICT, ABORTED = 400, 404, 409, 499
INTERNAL, UNAVAILABLE, DEADLINE = 500, 503, 504


class StatusError(ValueError):
    """A request or command that cannot be served as asked; carries the status code
    to report (400, 404, 409, ... as above)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
