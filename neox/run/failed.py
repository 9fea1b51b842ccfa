"""``RunFailed``: the run stops for a reason every rank knows at once."""

from __future__ import annotations





class RunFailed(Exception):
    """The run stops for a reason every rank knows at once (a diverged loss, a failed save);
    rank 0's exception carries the message, the others' carry None."""

    def __init__(self, message: str | None):
        super().__init__(message or "stopped; rank 0 reports why")
        self.message = message
