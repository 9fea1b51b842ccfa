"""``is_peer_loss``: whether an exception from a collective says that another rank of the group
is gone (exited, killed) or silent past the timeout, the consequence of that rank's failure
rather than a failure of this one. A rank that sees one says so in one line and leaves (neox's
ranks, examples/finetune_hf_trainer.py) instead of printing a traceback of the collective it
happened to be in (zerocore's, or one of transformers' or accelerate's own).
"""

from __future__ import annotations

import torch.distributed as dist

from zerocore.comm.peer_memory import PeerLost

__all__ = ["is_peer_loss"]

# How gloo and NCCL say it: gloo raises a plain RuntimeError from its transport ("Application
# timeout caused pair closure": an operation waiting on a pair that another one's timeout
# closed).
_BACKEND_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                  "gloo/transport", "NCCL communicator was aborted", "Timed out",
                  "Application timeout caused pair closure")


def is_peer_loss(e: BaseException) -> bool:
    """Whether ``e`` says that another rank of the group is gone or silent (see the module)."""
    if isinstance(e, (dist.DistBackendError, PeerLost)):
        return True
    return isinstance(e, RuntimeError) and any(w in str(e) for w in _BACKEND_WORDS)
